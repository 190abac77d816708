"""Disk used by a store (and its fleet roots), and a retention policy that bounds it.

Policy (`prune`): a fleet root keeps its newest `keep` published versions (the live one
always); versions newer than `current` are builds a writer died in and go. In the store,
an artifact stays when anything may still need it:

- it is running, or the run that made it is still running (a writer may be about to read it);
- it is the newest complete artifact of its stage;
- its stage holds results rather than caches (`train`: cartridges; `eval`, `bench`: records);
- it was made by a run that built a kept fleet version (that version's ingest, rounds, held-out
  sets and train_steps record);
- it is an input, directly or not, of an artifact that stays.

Everything else (superseded caches, failed artifacts) is removed: its directory, then its
catalog row. Every removed cache is content-keyed, so a run that needs it again recomputes the
same rows. Run reports (`runs/<run_id>/`) stay for the newest `keep_reports` runs and for runs
whose artifacts stay. A root another process is writing is skipped, never waited for.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from storage.catalog import CATALOG_FILE
from storage.lock import Busy, exclusive
from storage.store import Store, with_inputs
from storage.versions import VERSIONS, current, discard_unpublished, version_dirs

RESULT_STAGES = ("train", "eval", "bench")
KEEP_VERSIONS = 3
KEEP_REPORTS = 20
RUNS_DIR = "runs"
FLEET_FLOWS = ("retrain", "fleet-publish")


def tree_bytes(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the files below `path`, each inode counted once (fleet versions share hard links)."""
    seen = set() if seen is None else seen
    total = 0
    if path.is_file() and not path.is_symlink():
        files: Iterable[Path] = [path]
    elif path.is_dir() and not path.is_symlink():
        files = (p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    else:
        files = []
    for p in files:
        st = p.stat()
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen.add(key)
            total += st.st_size
    return total


def fleet_roots(store: Store, extra: Iterable[Path | str] = ()) -> list[Path]:
    """Published fleet roots the store's runs wrote, plus `extra`; only those that still exist."""
    found = [Path(r) for r in extra]
    for run in store.catalog.runs():
        root = (run["summary"] or {}).get("root")
        if run["flow"] in FLEET_FLOWS and root:
            found.append(Path(root))
    out: list[Path] = []
    for root in found:
        root = root.expanduser().resolve()
        if root.is_dir() and root not in out:
            out.append(root)
    return out


def usage(store: Store, roots: Iterable[Path | str] = ()) -> dict:
    """Disk used per stage, per run and per fleet root (bytes, hard links counted once)."""
    arts = store.catalog.artifacts()
    stages: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    for art in arts:
        size = tree_bytes(store.dir(art))
        s = stages.setdefault(art.stage, {"artifacts": 0, "complete": 0, "failed": 0, "running": 0, "bytes": 0})
        s["artifacts"] += 1
        s[art.status] = s.get(art.status, 0) + 1
        s["bytes"] += size
        r = runs.setdefault(art.run_id or "(none)", {"artifacts": 0, "bytes": 0, "report_bytes": 0})
        r["artifacts"] += 1
        r["bytes"] += size
    reports = store.root / RUNS_DIR
    if reports.is_dir():
        for d in reports.iterdir():
            r = runs.setdefault(d.name, {"artifacts": 0, "bytes": 0, "report_bytes": 0})
            r["report_bytes"] = tree_bytes(d)
    fleets = []
    for root in fleet_roots(store, roots):
        live = current(root)
        versions = [{"version": v.name, "bytes": tree_bytes(v), "live": live is not None and v.resolve() == live}
                    for v in version_dirs(root)]
        fleets.append({"root": str(root), "versions": versions, "bytes": tree_bytes(root)})
    return {
        "store": str(store.root), "bytes": tree_bytes(store.root),
        "catalog_bytes": tree_bytes(store.root / CATALOG_FILE),
        "reports_bytes": tree_bytes(reports),
        "stages": dict(sorted(stages.items())), "runs": dict(sorted(runs.items())), "fleets": fleets,
    }


def _prune_root(root: Path, keep: int, dry_run: bool) -> tuple[list[str], set[str]]:
    """(versions removed, names of versions kept) for one root; the caller holds its lock."""
    live = current(root)
    if live is None:
        return [], {v.name for v in version_dirs(root)}
    published = [v for v in version_dirs(root) if int(v.name) <= int(live.name)]
    newer = [v.name for v in version_dirs(root) if int(v.name) > int(live.name)]
    kept = {v.name for v in published[-keep:]} | {live.name}
    removed = [v.name for v in published if v.name not in kept] + newer
    if not dry_run:
        discard_unpublished(root)
        for name in removed:
            shutil.rmtree(root / VERSIONS / name, ignore_errors=True)
    return removed, kept


def prune(store: Store, keep: int = KEEP_VERSIONS, roots: Iterable[Path | str] = (), dry_run: bool = False,
          held: Iterable[Path | str] = (), protect: Iterable[str] = (), keep_reports: int = KEEP_REPORTS) -> dict:
    """Apply the retention policy (module docstring); returns what was (or would be) removed.

    `roots` adds fleet roots to those the catalog knows; `held` are roots whose lock the caller
    already holds and `protect` run ids whose artifacts stay (the retrain that just published)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    held_roots = {Path(h).expanduser().resolve() for h in held}
    before = tree_bytes(store.root)
    out: dict = {"versions": {}, "skipped_roots": [], "artifacts": [], "reports": [], "dry_run": dry_run}
    kept_versions: dict[str, set[str]] = {}
    for root in fleet_roots(store, [*roots, *held_roots]):
        before += tree_bytes(root)
        if root in held_roots:
            removed, kept = _prune_root(root, keep, dry_run)
        else:
            try:
                with exclusive(root, "store prune"):
                    removed, kept = _prune_root(root, keep, dry_run)
            except Busy as exc:
                out["skipped_roots"].append(str(exc))
                kept = {v.name for v in version_dirs(root)}
                removed = []
        out["versions"][str(root)] = removed
        kept_versions[str(root)] = kept

    runs = store.catalog.runs()
    live_runs = {r["run_id"] for r in runs if r["status"] == "running"} | set(protect)
    version_runs: set[str] = set()
    for run in runs:
        s = run["summary"] or {}
        root = s.get("root")
        if run["flow"] in FLEET_FLOWS and root and s.get("published"):
            resolved = str(Path(root).expanduser().resolve())
            if s.get("version") in kept_versions.get(resolved, set()):
                version_runs.update(x for x in (run["run_id"], s.get("fleet_run_id")) if x)

    everything = store.catalog.artifacts()
    by_id = {a.id: a for a in everything}
    kept_ids = {a.id for a in everything if a.status == "running" or a.run_id in live_runs
                or (a.status == "complete" and (a.stage in RESULT_STAGES or a.run_id in version_runs))}
    for stage in {a.stage for a in everything}:
        done = [a for a in everything if a.stage == stage and a.status == "complete"]
        if done:
            kept_ids.add(max(done, key=lambda a: (a.finished_at, a.created_at)).id)
    kept_ids = with_inputs(kept_ids, by_id)
    removed_arts = [a for a in everything if a.id not in kept_ids]
    out["artifacts"] = [a.id for a in removed_arts]

    kept_runs = {a.run_id for a in everything if a.id in kept_ids} | live_runs | version_runs
    newest = [r["run_id"] for r in sorted(runs, key=lambda r: r["started_at"], reverse=True)[:keep_reports]]
    reports = store.root / RUNS_DIR
    stale = sorted(d for d in reports.iterdir() if d.is_dir() and d.name not in kept_runs
                   and d.name not in newest) if reports.is_dir() else []
    out["reports"] = [d.name for d in stale]
    if not dry_run:
        for art in removed_arts:
            shutil.rmtree(store.dir(art), ignore_errors=True)
            store.catalog.delete(art.id)
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)
        for stage_dir in store.root.iterdir():  # stage directories left empty
            if stage_dir.is_dir() and stage_dir.name != RUNS_DIR:
                try:
                    os.rmdir(stage_dir)
                except OSError:
                    pass
    out["freed_bytes"] = before - (tree_bytes(store.root) + sum(tree_bytes(r) for r in map(Path, kept_versions)))
    if dry_run:
        out["freed_bytes"] = sum(tree_bytes(store.dir(a)) for a in removed_arts) + sum(tree_bytes(d) for d in stale)
    return out
