"""Prefect flows: thin orchestration over the plain stage functions."""

import os

# No network beyond package registries: keep Prefect's telemetry off unless set.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from flows.ephemeral import allow_first_start  # noqa: E402  (after the telemetry default)

allow_first_start()
