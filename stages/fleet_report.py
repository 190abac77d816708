"""Human-readable fleet run summaries (terminal lines and markdown for Prefect)."""

from __future__ import annotations


def _f(value) -> str:
    return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def summary_lines(s: dict) -> list[str]:
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


def markdown_summary(s: dict) -> str:
    """What trained, what was left untouched as unchanged, losses, timings, and the loss curve's path."""
    body = "\n".join(f"- {line.strip()}" for line in summary_lines(s))
    curve = ", ".join(f"{x:.3f}" for x in (s.get("losses") or [])[:100])
    trained = [d["name"] for d in s["documents"] if d.get("trained")]
    untouched = [d["name"] for d in s["documents"] if not d.get("trained")]
    return (f"# Fleet run {s.get('run_id', '')}\n\n{body}\n\n"
            f"- trained this run: {', '.join(trained) or 'none'}\n"
            f"- untouched (unchanged): {', '.join(untouched) or 'none'}\n"
            f"- removed: {', '.join(s.get('removed') or []) or 'none'}\n\n"
            f"Per-round loss: {curve or 'none (no rounds)'}\n\n"
            f"Loss curve: `{s.get('loss_png') or 'none (no rounds)'}`\n")
