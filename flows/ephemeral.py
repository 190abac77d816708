"""Prefect's temporary API server, made to survive a new machine's first start.

With no `PREFECT_API_URL`, every flow run starts a temporary server, which on a new
`PREFECT_HOME` first creates and migrates its SQLite database. Prefect gives it 20 s
(`PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`); a loaded 2-core machine needs
more than that on the first start, so the first command a newcomer runs failed. The
project raises the limit unless the user's environment or Prefect profile sets it or
points at a server of their own; a server that still does not start becomes one line.

Prefect stops the temporary server at interpreter exit; a run killed outright (SIGKILL,
the OOM killer) leaves it running, about 230 MB each. A server started under
`server_errors` carries its owner's pid in its environment (`CARTRIDGES_PREFECT_OWNER`),
and the next command that runs a flow stops those whose owner is gone (`reap_orphans`).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from cartridges.core.errors import CartridgeError

TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
# A healthy first start takes 15-40 s on a loaded 2-core machine; the limit only bounds a hang.
FIRST_START_TIMEOUT_S = 300


class PrefectStartError(CartridgeError):
    """The temporary Prefect server did not answer."""


def allow_first_start() -> None:
    """Give the temporary server time to migrate a new database, unless the user chose otherwise."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or "startup_timeout_seconds" in settings.server.ephemeral.model_fields_set:
        return  # the user's own server, or their own limit (environment or profile), wins
    os.environ[TIMEOUT_SETTING] = str(FIRST_START_TIMEOUT_S)  # inherited by workers and the server
    refresh_global_settings_context()


OWNER_ENV = "CARTRIDGES_PREFECT_OWNER"
SERVER_MODULE = b"prefect.server.api.server:create_app"


def _parent(entry: Path) -> int:
    stat = (entry / "stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # the fields after the command name: state, ppid


def orphaned_servers(proc: Path = Path("/proc")) -> list[int]:
    """Temporary Prefect servers started by a cartridges process that is no longer their parent
    (it died and they were re-parented). Servers of other programs carry no owner and are left alone."""
    found = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            if SERVER_MODULE not in (entry / "cmdline").read_bytes():
                continue
            owner = next((v for k, _, v in (e.partition(b"=") for e in (entry / "environ").read_bytes().split(b"\0"))
                          if k == OWNER_ENV.encode()), None)
            if owner is not None and owner.isdigit() and _parent(entry) != int(owner):
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def reap_orphans() -> list[int]:
    """Stop (SIGTERM) the temporary servers that killed cartridges runs left behind."""
    stopped = []
    for pid in orphaned_servers():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
    return stopped


@contextlib.contextmanager
def server_errors() -> Iterator[None]:
    """Turn Prefect's failure to reach its temporary server into one line that says what to set.

    Also marks the temporary server this process starts as its own, and first stops the ones
    that killed runs left behind."""
    reap_orphans()
    before = os.environ.get(OWNER_ENV)
    os.environ[OWNER_ENV] = str(os.getpid())  # inherited by the server Prefect starts for this run
    try:
        yield
    except RuntimeError as exc:
        if "ephemeral Prefect API server" not in str(exc):
            raise
        from prefect.settings import get_current_settings

        limit = get_current_settings().server.ephemeral.startup_timeout_seconds
        raise PrefectStartError(
            f"Prefect's temporary API server did not start within {limit} s; set {TIMEOUT_SETTING} higher, "
            "point PREFECT_API_URL at a running Prefect server, or pass --no-prefect") from None
    except ValueError as exc:
        if "No Prefect API URL provided" not in str(exc):
            raise
        raise PrefectStartError(
            "Prefect has no API to report to: the active Prefect profile sets no PREFECT_API_URL and turns the "
            "temporary server off; set PREFECT_API_URL, set PREFECT_SERVER_EPHEMERAL_ENABLED=true, "
            "or pass --no-prefect") from None
    finally:  # processes started after the block are not this run's server
        if before is None:
            os.environ.pop(OWNER_ENV, None)
        else:
            os.environ[OWNER_ENV] = before
