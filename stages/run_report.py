"""What a run leaves beside its artifacts: `runs/<run_id>/summary.md` and `loss.png`.

The flows publish the same markdown as a Prefect artifact; the catalog's `runs` table
keeps the summary (with these paths) for SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from storage import Store
from storage.atomic import atomic_path, atomic_write_bytes


def loss_curve_png(losses: list[float], path: Path, title: str) -> Path | None:
    """A per-step loss curve (matplotlib, Agg); None when there are no losses."""
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(len(losses)), losses, marker="." if len(losses) < 60 else None, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path


def write_run_report(store: Store, summary: dict, render: Callable[[dict], str], title: str) -> str:
    """Write the run's loss curve and markdown under the store; adds their paths to `summary`
    (`report`, `loss_png`) and returns the markdown."""
    directory = store.root / "runs" / summary["run_id"]
    directory.mkdir(parents=True, exist_ok=True)
    png = loss_curve_png(summary.get("losses") or [], directory / "loss.png", title)
    summary["loss_png"] = str(png) if png else None
    summary["report"] = str(directory / "summary.md")
    markdown = render(summary)
    atomic_write_bytes(directory / "summary.md", markdown.encode("utf-8"))
    return markdown
