"""Deployments: their names, schedule and concurrency limit; and a real local Prefect server
started like `make deploy`, on which `prefect deployment run 'fleet/default'` builds a tiny fleet."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from flows.deploy import DeployConfig, deployments
from storage import Store
from storage.faults import ENV as FAULT_ENV
from storage.faults import WAIT_ENV
from storage.versions import current
from tests.test_fleet_run import write_docs

REPO = Path(__file__).resolve().parent.parent


def by_name(cfg):
    return {f"{d.flow_name}/{d.name}": d for d in deployments(cfg)}


def test_three_deployments_with_a_retrain_schedule_and_a_concurrency_limit_of_one():
    found = by_name(DeployConfig(fleet="f", docs=["a", "b"], retrain_interval=900))
    assert set(found) == {"cartridge/default", "fleet/default", "retrain/scheduled"}
    retrain = found["retrain/scheduled"]
    assert retrain.concurrency_limit == 1
    assert [s.schedule.interval.total_seconds() for s in retrain.schedules] == [900]
    assert retrain.parameters["docs"] == ["a", "b"] and retrain.parameters["fleet"] == "f"
    assert found["fleet/default"].parameters["publish"] is True
    assert found["fleet/default"].schedules == [] and found["cartridge/default"].schedules == []
    assert found["fleet/default"].concurrency_limit is None
    cron = by_name(DeployConfig(retrain_cron="0 3 * * *"))["retrain/scheduled"]
    assert [s.schedule.cron for s in cron.schedules] == ["0 3 * * *"]
    assert {d.entrypoint for d in found.values()} == {
        "flows/cartridge.py:cartridge_flow", "flows/fleet.py:fleet_flow", "flows/retrain.py:retrain_flow"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flow_run_state(port: int, run_id: str) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/api/flow_runs/{run_id}", timeout=10).json()["state"]["type"]


def wait_until(check, timeout: float, what: str) -> float:
    """Seconds until `check()` is true; fails the test after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - start


def test_make_deploy_then_a_cancelled_run_then_a_run_that_builds_the_fleet_then_stop(tmp_path, tiny_model_dir):
    """`prefect flow-run cancel` on a deployment run held in its first round: the run ends
    Cancelled, its catalog run is closed as failed with the store consistent and nothing
    published, and the next run of the deployment proceeds and publishes the fleet."""
    from tests.crash import check_store

    docs = write_docs(tmp_path / "docs")
    marker = tmp_path / "waiting.pid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_PROFILES_PATH=str(tmp_path / "profiles.toml"), PYTHONPATH=str(REPO),
               PREFECT_HOME=str(tmp_path / "home"),
               # the first flow run waits in round 1 until it is signalled; later runs pass through
               **{FAULT_ENV: "fleet.round.1:wait", WAIT_ENV: str(marker)})
    deploy = tmp_path / "deploy"
    port = free_port()
    start = [sys.executable, "-m", "flows.deploy", "start", "--dir", str(deploy), "--port", str(port),
             "--model", str(tiny_model_dir), "--preset", "smoke", "--store", str(tmp_path / "store"),
             "--fleet", str(tmp_path / "fleet"), "--docs", "unused"]
    prefect = str(Path(sys.executable).parent / "prefect")
    params = ["-p", f"docs={json.dumps([str(docs)])}"]
    up = subprocess.run(start, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        profiles = (tmp_path / "profiles.toml").read_text()
        assert 'active = "cartridges"' in profiles and f"http://127.0.0.1:{port}/api" in profiles
        # a fresh shell: no PREFECT_API_URL, only the profile
        first = subprocess.run([prefect, "deployment", "run", "fleet/default", *params], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stdout + first.stderr
        run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", first.stdout).group(1)
        wait_until(marker.exists, 400, "the first flow run to reach round 1")
        cancel = subprocess.run([prefect, "flow-run", "cancel", run_id], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=60)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        seconds = wait_until(lambda: flow_run_state(port, run_id) == "CANCELLED", 120, "the run to be cancelled")
        waiting = int(marker.read_text())
        wait_until(lambda: not Path(f"/proc/{waiting}").exists(), 60, "the cancelled run's process to end")
        assert current(tmp_path / "fleet") is None  # nothing published
        runs = Store(tmp_path / "store", read_only=True).catalog.runs()
        assert [r["status"] for r in runs if r["flow"] == "fleet"] == ["failed"], runs
        check_store(tmp_path / "store")
        print(f"cancelled in {seconds:.1f} s after `prefect flow-run cancel`")

        run = subprocess.run([prefect, "deployment", "run", "fleet/default", *params,
                              "--watch", "--watch-timeout", "400"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=450)
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout + run.stderr
        runs = {r["flow"]: r for r in Store(tmp_path / "store").catalog.runs() if r["status"] == "complete"}
        assert runs["fleet-publish"]["status"] == "complete" and runs["fleet"]["status"] == "complete"
        assert current(tmp_path / "fleet").name == "0001"
        assert len(runs["fleet-publish"]["summary"]["new"]) == 3
        import httpx

        keys = {a["key"] for a in httpx.post(f"http://127.0.0.1:{port}/api/artifacts/filter", json={}).json()}
        assert {"fleet-summary"} <= keys
    finally:
        pids = [int((deploy / f).read_text().split()[0]) for f in ("server.pid", "serve.pid") if (deploy / f).exists()]
        down = subprocess.run([sys.executable, "-m", "flows.deploy", "stop", "--dir", str(deploy)], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert len(pids) == 2 and not [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not (deploy / "server.pid").exists() and 'active = "cartridges"' not in (tmp_path / "profiles.toml").read_text()
