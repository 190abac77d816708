"""What a run leaves beside its artifacts, and what it prints: one summary per kind of job.

Each job's summary dict becomes terminal lines (`summary_lines`) and one markdown
document (`markdown_summary`), written to `runs/<run_id>/summary.md` with the loss
curve `loss.png`; the flows publish the same markdown as a Prefect artifact, and the
catalog's `runs` table keeps the summary (with these paths) for SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from storage import Store
from storage.atomic import atomic_path, atomic_write_bytes


def _f(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _names(s: dict, key: str) -> str:
    return ", ".join(s.get(key) or []) or "none"


def cartridge_lines(s: dict) -> list[str]:
    change = None
    if s.get("heldout_loss_before") and s.get("heldout_loss_after") is not None:
        change = (s["heldout_loss_after"] - s["heldout_loss_before"]) / s["heldout_loss_before"]
    return [
        f"held-out loss {_f(s.get('heldout_loss_before'))} -> {_f(s.get('heldout_loss_after'))}"
        + (f" ({change:+.1%})" if change is not None else ""),
        f"conversations {s['conversations']} used of {s['planned_conversations']} planned "
        f"(bot A ok {s['a_ok_rate']:.0%}, bot B degenerate {s['b_degenerate_rate']:.0%}); "
        f"seed types {s['seed_types']}",
        f"coverage per token: min {s['coverage_min']}, mean {s['coverage_mean']:.2f} training spans "
        f"(over {s['corpus_tokens']} corpus tokens); fact coverage {s['fact_coverage']:.0%} of sentences "
        "(see the sentences table)",
        f"self-study {s['s_per_conversation']:.2f} s/conversation; training {s['steps']} steps, "
        f"{s['supervised_tokens']} supervised tokens in {s['train_seconds']:.1f}s",
        f"skipped unchanged stages: {', '.join(s.get('skipped') or []) or 'none'}",
        f"cartridge: {s.get('cartridge')}",
        *([f"HEALTH CHECK FAILED: {s['health_reason']} (run recorded as failed; try another seed)"]
          if s.get("health") == "failed" else []),
    ]


def fleet_lines(s: dict) -> list[str]:
    lines = [f"fleet {s['fleet']}: {s['rounds_run']} rounds this run, {s['rounds']} in all; "
             f"residents {', '.join(s['residents']) or 'none'}; index {s['index_chunks']} chunks"]
    for d in s["documents"]:
        line = (f"  {d['name']}: {d['steps']} steps, held-out loss {_f(d.get('heldout_before'))} -> "
                f"{_f(d.get('heldout_after'))}")
        if "heldout_coloaded" in d:
            line += f" (co-loaded {_f(d['heldout_coloaded'])})"
        if d.get("changed"):
            line += " [initialized this run]"
        if d.get("health_reason"):
            line += f" [check: {d['health_reason']}]"
        lines.append(line)
    if s.get("removed"):
        lines.append(f"  removed: {', '.join(s['removed'])}")
    lines.append(f"  {s['seconds']:.1f}s")
    return lines


def retrain_lines(s: dict) -> list[str]:
    return [f"trained: {_names(s, 'trained')} ({s['rounds_run']} rounds)",
            f"new: {_names(s, 'new')}", f"changed: {_names(s, 'changed')}",
            f"removed (retired): {_names(s, 'removed')}", f"skipped as unchanged: {_names(s, 'unchanged')}",
            f"version: {s.get('version')} ({'published' if s.get('published') else 'not republished'})",
            f"reload: {s.get('notified') or 'not requested'}", f"{s.get('seconds', 0.0):.1f} s"]


def _cartridge_extra(s: dict) -> str:
    table = ["| stage | artifact | this run | rows | seconds |", "|---|---|---|---|---|"]
    for st in s.get("stages") or []:
        table.append(f"| {st['stage']} | `{st['artifact']}` | {'skipped (unchanged)' if st['skipped'] else 'ran'} "
                     f"| {st['rows']} | {_seconds(st['seconds'])} |")
    return "\n".join(table) + f"\n\nTotal {_seconds(s.get('seconds'))} s."


def _fleet_extra(s: dict) -> str:
    trained = [d["name"] for d in s["documents"] if d.get("trained")]
    untouched = [d["name"] for d in s["documents"] if not d.get("trained")]
    return (f"- trained this run: {', '.join(trained) or 'none'}\n"
            f"- untouched (unchanged): {', '.join(untouched) or 'none'}\n"
            f"- removed: {', '.join(s.get('removed') or []) or 'none'}")


# kind -> (title, terminal lines, what each loss is per, markdown after the lines)
KINDS: dict[str, tuple[str, Callable[[dict], list[str]], str, Callable[[dict], str] | None]] = {
    "cartridge": ("Cartridge run", cartridge_lines, "step", _cartridge_extra),
    "fleet": ("Fleet run", fleet_lines, "round", _fleet_extra),
    "retrain": ("Published fleet run", retrain_lines, "round", None),
}


def summary_lines(s: dict) -> list[str]:
    return KINDS[s["kind"]][1](s)


def markdown_summary(s: dict) -> str:
    """What ran and what was left as unchanged, losses, timings, and the loss curve's path."""
    title, lines, per, extra = KINDS[s["kind"]]
    parts = [f"# {title} {s.get('run_id', '')}"]
    if s.get("message"):
        parts.append(s["message"])
    parts.append("\n".join(f"- {line.strip()}" for line in lines(s)))
    if extra is not None:
        parts.append(extra(s))
    losses = s.get("losses") or []
    parts.append(f"Per-{per} loss: " + (", ".join(f"{x:.3f}" for x in losses[:100]) or "none"))
    parts.append(f"Loss curve: `{s.get('loss_png') or 'none (no training)'}`")
    return "\n\n".join(parts) + "\n"


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


def write_run_report(store: Store, summary: dict) -> str:
    """Write the run's loss curve and markdown under the store; adds their paths to `summary`
    (`report`, `loss_png`) and returns the markdown."""
    directory = store.root / "runs" / summary["run_id"]
    directory.mkdir(parents=True, exist_ok=True)
    title = f"{summary['kind']} run {summary['run_id']}"
    png = loss_curve_png(summary.get("losses") or [], directory / "loss.png", title)
    summary["loss_png"] = str(png) if png else None
    summary["report"] = str(directory / "summary.md")
    markdown = markdown_summary(summary)
    atomic_write_bytes(directory / "summary.md", markdown.encode("utf-8"))
    return markdown
