"""Steps of a job as Prefect tasks, and a run's report as a Prefect artifact.

Prefect's own task caching is off (`cache_policy=NONE`): the catalog's fingerprints
are the one cache. Arguments pass through untouched (`quote`), so Prefect neither
inspects nor copies stores, models or artifacts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.utilities.annotations import quote


def as_task(fn: Callable, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
    """Run `fn` as a Prefect task named `name` (by default after the function)."""
    label = name or getattr(fn, "__name__", "step").strip("_")
    if label == "run":  # a stage's run function: name the task after its stage module
        label = fn.__module__.rsplit(".", 1)[-1]
    wrapped = task(fn, name=label, cache_policy=NONE, persist_result=False)
    return wrapped(*[quote(a) for a in args], **{k: quote(v) for k, v in kwargs.items()})


def publish_report(summary: dict, key: str, description: str) -> None:
    """The run's markdown report (written by the job under the store) as a Prefect artifact."""
    markdown = Path(summary["report"]).read_text(encoding="utf-8")
    create_markdown_artifact(markdown=markdown, key=key, description=description)
