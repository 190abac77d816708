"""A newcomer's first run: a real flow from an empty PREFECT_HOME on one loaded core.

Prefect's temporary API server creates and migrates its SQLite database on its first
start. On one core shared with a busy process that takes longer than Prefect's 20 s
default, so the first `cartridges train` of a new machine failed; the project raises
the limit unless the user set their own (environment or profile) or their own server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.ephemeral import FIRST_START_TIMEOUT_S, TIMEOUT_SETTING

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("cartridges"))
LOADED_S = 90


def fresh_env(tmp_path: Path, **extra: str) -> dict:
    """The environment of a new machine: no Prefect home, server or limit of the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               HF_HOME=str(tmp_path / "hf"), **extra)
    return env


def one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def limit_seen(env: dict) -> tuple[str | None, int]:
    code = ("import os, flows; from prefect.settings import get_current_settings as s; "
            f"print(os.environ.get('{TIMEOUT_SETTING}'), s().server.ephemeral.startup_timeout_seconds)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return (None if out[0] == "None" else out[0]), int(out[1])


def write_profile(env: dict, **settings: str) -> None:
    home = Path(env["PREFECT_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    settings = {"PREFECT_SERVER_EPHEMERAL_ENABLED": "true", **settings}  # as Prefect's own default profile
    lines = ['active = "mine"', "", "[profiles.mine]"] + [f'{k} = "{v}"' for k, v in settings.items()]
    (home / "profiles.toml").write_text("\n".join(lines) + "\n")


def test_the_project_raises_the_first_start_limit_only_where_the_user_set_none(tmp_path):
    assert limit_seen(fresh_env(tmp_path)) == (str(FIRST_START_TIMEOUT_S), FIRST_START_TIMEOUT_S)
    assert limit_seen(fresh_env(tmp_path, **{TIMEOUT_SETTING: "45"})) == ("45", 45)
    assert limit_seen(fresh_env(tmp_path, PREFECT_API_URL="http://127.0.0.1:9/api"))[1] == 20
    env = fresh_env(tmp_path / "profiled")
    write_profile(env, **{TIMEOUT_SETTING: "33"})
    assert limit_seen(env) == (None, 33)


@pytest.mark.slow
def test_a_server_that_does_not_start_is_one_line_naming_the_setting(tmp_path):
    env = fresh_env(tmp_path)
    write_profile(env, **{TIMEOUT_SETTING: "1"})  # the user's own limit wins, and is too short
    run = subprocess.run([CLI, "train", "--preset", "smoke", "--corpus", "docs/eval/raft.md",
                          "--store", str(tmp_path / "store")], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    [error] = [line for line in run.stderr.splitlines() if line.startswith("error:")]  # Prefect's own logs aside
    assert error.startswith("error: Prefect's temporary API server did not start within 1 s")
    assert TIMEOUT_SETTING in error and "--no-prefect" in error and "Traceback" not in run.stderr


@pytest.mark.slow
def test_a_profile_with_no_server_at_all_is_one_line(tmp_path):
    env = fresh_env(tmp_path)
    write_profile(env, PREFECT_SERVER_EPHEMERAL_ENABLED="false")
    run = subprocess.run([CLI, "train", "--preset", "smoke", "--corpus", "docs/eval/raft.md",
                          "--store", str(tmp_path / "store")], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    [error] = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: Prefect has no API to report to")


@pytest.mark.slow
def test_the_first_flow_run_on_a_new_machine_passes_on_one_loaded_core(tmp_path, tiny_model_dir):
    env = fresh_env(tmp_path)
    # Two busy processes share the core through the server's first start (a loaded machine).
    spin = f"import time\nend = time.time() + {LOADED_S}\nwhile time.time() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin], preexec_fn=one_core) for _ in range(2)]
    try:
        run = subprocess.run([CLI, "train", "--preset", "smoke", "--corpus", "docs/eval/raft.md",
                              "--model", str(tiny_model_dir), "--no-filter", "--store", str(tmp_path / "store"),
                              "--save", str(tmp_path / "c.safetensors"), "--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                             preexec_fn=one_core)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    assert run.returncode in (0, 3), run.stderr[-3000:]  # 3: trained, but the health bar missed (a random model)
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["steps"] > 0 and (tmp_path / "c.safetensors").is_file()
    assert "Starting temporary server" in run.stdout + run.stderr  # a real ephemeral server, started fresh
    assert (tmp_path / "prefect" / "prefect.db").is_file()
    assert summary["dtype"] in ("float32", "bfloat16") and summary["dtype_reason"]
