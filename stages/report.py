"""Human-readable run summaries (markdown for Prefect, lines for the terminal)."""

from __future__ import annotations


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def summary_lines(s: dict) -> list[str]:
    change = None
    if s.get("heldout_loss_before") and s.get("heldout_loss_after") is not None:
        change = (s["heldout_loss_after"] - s["heldout_loss_before"]) / s["heldout_loss_before"]
    return [
        f"held-out loss {_fmt(s.get('heldout_loss_before'))} -> {_fmt(s.get('heldout_loss_after'))}"
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


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown_summary(s: dict) -> str:
    """What ran and what was skipped as unchanged, losses, timings, and the loss curve's path."""
    losses = s.get("losses") or []
    curve = ", ".join(f"{x:.3f}" for x in losses[:50])
    body = "\n".join(f"- {line}" for line in summary_lines(s))
    table = ["| stage | artifact | this run | rows | seconds |", "|---|---|---|---|---|"]
    for st in s.get("stages") or []:
        table.append(f"| {st['stage']} | `{st['artifact']}` | {'skipped (unchanged)' if st['skipped'] else 'ran'} "
                     f"| {st['rows']} | {_seconds(st['seconds'])} |")
    return (f"# Cartridge run {s.get('run_id', '')}\n\n{body}\n\n" + "\n".join(table)
            + f"\n\nTotal {_seconds(s.get('seconds'))} s. Per-step loss: {curve}\n\n"
            + f"Loss curve: `{s.get('loss_png') or 'none (no training steps)'}`\n")
