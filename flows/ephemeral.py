"""Prefect's temporary API server, made to survive a new machine's first start.

With no `PREFECT_API_URL`, every flow run starts a temporary server, which on a new
`PREFECT_HOME` first creates and migrates its SQLite database. Prefect gives it 20 s
(`PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`); a loaded 2-core machine needs
more than that on the first start, so the first command a newcomer runs failed. The
project raises the limit unless the user's environment or Prefect profile sets it or
points at a server of their own; a server that still does not start becomes one line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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


@contextlib.contextmanager
def server_errors() -> Iterator[None]:
    """Turn Prefect's failure to reach its temporary server into one line that says what to set."""
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
