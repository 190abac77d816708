"""Deployments: their names, schedule and concurrency limit; and a real local Prefect server
started like `make deploy`, on which `prefect deployment run 'fleet/default'` builds a tiny fleet."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from flows.deploy import DeployConfig, deployments
from storage import Store
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


def test_make_deploy_then_prefect_deployment_run_builds_a_fleet_then_stop(tmp_path, tiny_model_dir):
    docs = write_docs(tmp_path / "docs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_PROFILES_PATH=str(tmp_path / "profiles.toml"), PYTHONPATH=str(REPO),
               PREFECT_HOME=str(tmp_path / "home"))
    deploy = tmp_path / "deploy"
    port = free_port()
    start = [sys.executable, "-m", "flows.deploy", "start", "--dir", str(deploy), "--port", str(port),
             "--model", str(tiny_model_dir), "--preset", "smoke", "--store", str(tmp_path / "store"),
             "--fleet", str(tmp_path / "fleet"), "--docs", "unused"]
    up = subprocess.run(start, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        profiles = (tmp_path / "profiles.toml").read_text()
        assert 'active = "cartridges"' in profiles and f"http://127.0.0.1:{port}/api" in profiles
        # a fresh shell: no PREFECT_API_URL, only the profile
        run = subprocess.run([str(Path(sys.executable).parent / "prefect"), "deployment", "run", "fleet/default",
                              "-p", f"docs={json.dumps([str(docs)])}", "--watch", "--watch-timeout", "400"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=450)
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout + run.stderr
        runs = {r["flow"]: r for r in Store(tmp_path / "store").catalog.runs()}
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
