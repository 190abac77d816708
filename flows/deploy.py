"""Deployments `cartridge/default`, `fleet/default` and `retrain/scheduled`, and the processes behind them.

    python -m flows.deploy start [--port 4200] [--dir .deploy] ...   # what `make deploy` runs
    python -m flows.deploy stop [--dir .deploy]                      # what `make deploy-stop` runs
    python -m flows.deploy serve ...                                 # the serving process alone

`start` launches a local Prefect server (SQLite under DIR, bound to 127.0.0.1) and one
long-running process that serves the three deployments (`prefect.serve`), each in the
background with its PID in DIR; it waits until both are healthy and saves the API
address in the Prefect profile `cartridges`, made active so a fresh shell finds the
server. `stop` ends exactly the process groups those PID files name and makes the
previously active profile active again. With PREFECT_API_URL already set (an existing
server), run `serve` alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILE = "cartridges"
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class DeployConfig:
    """Default parameters of the deployments and the retrain schedule (cron wins over interval)."""

    docs: list[str] = field(default_factory=lambda: ["docs"])
    fleet: str = "artifacts/fleet"
    corpus: list[str] = field(default_factory=lambda: ["docs/corpus/deflate.md"])
    store: str | None = None
    model: str | None = None
    preset: str = "default"
    retrain_interval: float = 3600.0
    retrain_cron: str | None = None
    serve_url: str | None = None
    serve_pid_file: str | None = None


def deployments(cfg: DeployConfig = DeployConfig()) -> list:
    """The three deployments (RunnerDeployment objects; nothing is sent to a server here)."""
    from flows.cartridge import cartridge_flow
    from flows.fleet import fleet_flow
    from flows.retrain import retrain_flow

    common = {"store_root": cfg.store, "model": cfg.model}
    schedule = {"cron": cfg.retrain_cron} if cfg.retrain_cron else {"interval": cfg.retrain_interval}
    reload = {"serve_url": cfg.serve_url, "serve_pid_file": cfg.serve_pid_file}
    return [
        cartridge_flow.to_deployment(
            name="default", parameters={"corpus": cfg.corpus, "preset": cfg.preset, **common},
            description="one corpus to one trained cartridge"),
        fleet_flow.to_deployment(
            name="default", parameters={"docs": cfg.docs, "fleet": cfg.fleet, "preset": cfg.preset,
                                        "publish": True, **reload, **common},
            description="one cartridge per document; publishes a new version of the fleet root"),
        retrain_flow.to_deployment(
            name="scheduled", parameters={"docs": cfg.docs, "fleet": cfg.fleet, **reload, **common},
            concurrency_limit=1, description="retrain changed documents, publish, reload the server",
            **schedule),
    ]


def serve(cfg: DeployConfig) -> None:
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(cfg))


# ---- the background processes of `make deploy` ---------------------------------------------


def _start_time(pid: int) -> str | None:
    """The process's start time (jiffies since boot), so a reused PID is not mistaken for ours."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid_file: Path) -> int | None:
    """The PID in the file when that very process still runs."""
    try:
        pid_text, started = pid_file.read_text().split()[:2]
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    return pid if _start_time(pid) == started else None


def _spawn(cmd: list[str], env: dict, log: Path, pid_file: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    pid_file.write_text(f"{proc.pid} {_start_time(proc.pid)}\n")
    return proc


def _wait(check, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode}; see {log}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout:.0f}s; see {log}")


def _save_profile(url: str, state: Path) -> str | None:
    """Profile `cartridges` with PREFECT_API_URL=url, made active; returns the one active before."""
    from prefect.settings import PREFECT_API_URL
    from prefect.settings.profiles import load_profiles, save_profiles

    profiles = load_profiles()
    previous = profiles.active_name
    profiles.update_profile(PROFILE, {PREFECT_API_URL: url})
    profiles.set_active(PROFILE)
    save_profiles(profiles)
    if previous != PROFILE:
        state.write_text(json.dumps({"previous_profile": previous}))
    return previous


def start(cfg: DeployConfig, directory: Path, port: int, timeout: float = 180.0) -> str:
    import httpx

    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    server_pid, serve_pid = directory / "server.pid", directory / "serve.pid"
    if _alive(server_pid) or _alive(serve_pid):
        raise SystemExit(f"already running (PID files in {directory}); stop it with `make deploy-stop`")
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(directory / "server-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = directory / "server.log"
    proc = _spawn([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                  env, log, server_pid)
    _wait(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, "Prefect server", proc, log, timeout)

    env = dict(os.environ, PREFECT_API_URL=url, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    log = directory / "serve.log"
    args = [sys.executable, "-m", "flows.deploy", "serve", "--config", json.dumps(asdict(cfg))]
    proc = _spawn(args, env, log, serve_pid)
    wanted = {"cartridge/default", "fleet/default", "retrain/scheduled"}

    def served() -> bool:
        found = httpx.post(f"{url}/deployments/filter", json={}, timeout=5).json()
        flows = {f["id"]: f["name"] for f in httpx.post(f"{url}/flows/filter", json={}, timeout=5).json()}
        names = {f"{flows.get(d['flow_id'])}/{d['name']}" for d in found}
        return wanted <= names and "being served" in log.read_text(errors="replace")

    _wait(served, "deployment server", proc, log, timeout)
    _save_profile(url, directory / "profile.json")
    return url


def _stop_group(pid_file: Path, what: str, timeout: float = 30.0) -> None:
    pid = _alive(pid_file)
    if pid is None:
        print(f"{what}: not running")
        pid_file.unlink(missing_ok=True)
        return
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _start_time(pid) is not None and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.2)
    if _start_time(pid) is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    print(f"{what}: stopped (pid {pid})")


def stop(directory: Path) -> None:
    directory = directory.resolve()
    _stop_group(directory / "serve.pid", "deployment server")
    _stop_group(directory / "server.pid", "Prefect server")
    state = directory / "profile.json"
    if state.is_file():
        from prefect.settings.profiles import load_profiles, save_profiles

        previous = json.loads(state.read_text()).get("previous_profile")
        profiles = load_profiles()
        if profiles.active_name == PROFILE and previous in profiles.names:
            profiles.set_active(previous)
            save_profiles(profiles)
            print(f"Prefect profile {previous!r} is active again")
        state.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("start", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--config", default=None, help="DeployConfig fields as JSON")
        p.add_argument("--docs", nargs="+", default=None)
        p.add_argument("--fleet", default=None)
        p.add_argument("--store", default=None)
        p.add_argument("--model", default=None)
        p.add_argument("--preset", default=None)
        p.add_argument("--retrain-interval", type=float, default=None, help="seconds between retrain runs")
        p.add_argument("--retrain-cron", default=None, help="cron schedule of retrain runs (wins over interval)")
        p.add_argument("--serve-url", default=None, help="server to reload after publishing")
        p.add_argument("--serve-pid-file", default=None, help="or: SIGHUP the server PID in this file")
        if name == "start":
            p.add_argument("--dir", default=".deploy", help="PID files, logs and the server's SQLite database")
            p.add_argument("--port", type=int, default=4200)
    p = sub.add_parser("stop")
    p.add_argument("--dir", default=".deploy")
    args = parser.parse_args(argv)
    if args.command == "stop":
        stop(Path(args.dir))
        return 0
    fields = json.loads(args.config) if args.config else {}
    for key in ("docs", "fleet", "store", "model", "preset", "retrain_interval", "retrain_cron", "serve_url",
                "serve_pid_file"):
        value = getattr(args, key)
        if value not in (None, ""):
            fields[key] = value
    cfg = DeployConfig(**fields)
    if args.command == "serve":
        serve(cfg)
        return 0
    url = start(cfg, Path(args.dir), args.port)
    print(f"Prefect server and deployments up at {url} (profile {PROFILE!r} is active; UI at {url[:-4]})")
    print("  prefect deployment run 'fleet/default' -p docs='[\"docs\"]'")
    print(f"  logs and PID files in {Path(args.dir).resolve()}; stop with `make deploy-stop`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
