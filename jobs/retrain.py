"""Retraining a published fleet when its documents change, and publishing the new version.

A published fleet root holds `versions/NNNN/` (each a complete fleet directory) and
`current`, a symlink to the live one. A retrain run:

1. ingests the documents and compares each one's sha256 with the live version's
   manifest (the same hashes the catalog's `documents` table holds);
2. with nothing new, changed or removed, stops: no training, no new version;
3. otherwise builds the next version as hard links of the live one and runs the fleet
   job on it with `resume`: changed and new documents are (re)initialized and only
   they train, removed ones leave, unchanged ones keep their files (byte-identical)
   and step counts; the index is rebuilt. Only removals: no rounds, a new index;
4. switches `current` to the new version atomically, keeps the newest few versions, prunes
   the store by the retention policy (storage/retention.py), and tells a running
   `cartridges serve --fleet` to reload (POST /admin/reload, or SIGHUP to the PID in a
   file); a server that does not answer is a warning.

A fleet directory made by `cartridges fleet` (no `versions/`) is accepted as the
source of the first version. Nothing here knows about Prefect.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cartridges.core.errors import FleetError
from cartridges.core.models import LoadedModel
from cartridges.fleet.manifest import MANIFEST, Manifest, read_manifest
from jobs import Call, plain
from jobs.fleet import fleet_files, run_fleet
from jobs.report import write_run_report
from schemas import FleetConfig
from schemas.presets import fleet_preset
from stages import ingest
from stages.fanout import Fanout
from stages.job import Job
from storage import Store
from storage.lock import exclusive
from storage.retention import prune
from storage.versions import (
    current,
    discard,
    discard_unpublished,
    is_versioned,
    new_version,
    publish,
)

NAME = "retrain"
KEEP_VERSIONS = 3
SERVE_URL_ENV = "CARTRIDGES_SERVE_URL"
API_KEY_ENV = "CARTRIDGES_API_KEY"


def live_version(root: Path | str) -> Path | None:
    """The fleet directory now being served from `root` (None: nothing built yet)."""
    root = Path(root)
    if is_versioned(root):
        return current(root)
    return root if (root / MANIFEST).is_file() else None


def retrain_config(root: Path | str, preset: str | None = None, overrides: dict | None = None) -> FleetConfig:
    """Without a preset, the live fleet's own config (so a retrain trains like the build did)."""
    live = live_version(root)
    if preset is None and live is not None:
        merged = dict(read_manifest(live).config)
        for key, value in (overrides or {}).items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
        return FleetConfig.from_dict(merged)
    return fleet_preset(preset or "default", overrides)


def changes(documents: list[dict], manifest: Manifest | None) -> dict[str, list[str]]:
    """Document names by what happened to them since the manifest: new, changed, removed, unchanged."""
    old = {d.name: d.sha256 for d in manifest.documents} if manifest else {}
    given = {d["name"]: d["sha256"] for d in documents}
    return {
        "new": sorted(n for n in given if n not in old),
        "changed": sorted(n for n in given if n in old and old[n] != given[n]),
        "removed": sorted(n for n in old if n not in given),
        "unchanged": sorted(n for n in given if n in old and old[n] == given[n]),
    }


def notify_reload(url: str | None = None, pid_file: str | Path | None = None, api_key: str | None = None,
                  log: Callable[[str], None] = print, timeout: float = 10.0) -> dict[str, Any]:
    """Tell a running server to reload: POST `url`/admin/reload and/or SIGHUP the PID in `pid_file`.

    `url` defaults to $CARTRIDGES_SERVE_URL, `api_key` to $CARTRIDGES_API_KEY. Failures are
    logged warnings, never errors: the new version is published either way.
    """
    url = url or os.environ.get(SERVE_URL_ENV)
    api_key = api_key or os.environ.get(API_KEY_ENV)
    out: dict[str, Any] = {}
    if url:
        import httpx

        target = url.rstrip("/") + "/admin/reload"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            reply = httpx.post(target, headers=headers, timeout=timeout)
            out["http"] = {"url": target, "status": reply.status_code}
            if reply.status_code >= 300:
                log(f"warning: reload request to {target} answered {reply.status_code}: {reply.text[:200]}")
            else:
                log(f"server at {url} reloaded")
        except httpx.HTTPError as exc:
            out["http"] = {"url": target, "error": str(exc)}
            log(f"warning: could not reach the server at {target} ({exc}); it keeps serving the old version")
    if pid_file:
        try:
            pid = int(Path(pid_file).read_text().split()[0])
            os.kill(pid, signal.SIGHUP)
            out["sighup"] = {"pid": pid}
            log(f"sent SIGHUP to server pid {pid}")
        except (OSError, ValueError, IndexError) as exc:
            out["sighup"] = {"pid_file": str(pid_file), "error": str(exc)}
            log(f"warning: could not signal the server from {pid_file} ({exc})")
    return out


def run_retrain(
    store: Store, lm: LoadedModel, docs: list[str | Path], root: str | Path, config: FleetConfig,
    call: Call = plain, log: Callable[[str], None] = print, fanout: Fanout | None = None,
    notify: Callable[[], dict] | None = None, keep: int = KEEP_VERSIONS, only_changed: bool = True,
    lock_wait: float = 0.0,
) -> dict:
    """Retrain what changed under `root` and publish it as a new version; returns the run summary.

    `only_changed=False` is the fleet flow publishing into a root: it always runs the fleet job
    (with nothing new or changed, the whole fleet continues training) and publishes the result.
    One writer per root: another one holding it makes this wait up to `lock_wait` seconds, then
    raise `storage.lock.Busy` naming it.
    """
    root = Path(root)
    started = time.perf_counter()
    files = fleet_files(docs, config.ingest)
    with exclusive(root, NAME if only_changed else "fleet-publish", lock_wait):
        discard_unpublished(root)  # a version a killed writer was building: never published, never served
        run_id = store.catalog.start_run(NAME if only_changed else "fleet-publish")
        with store.catalog.failing_run(run_id):
            docs_art = call(ingest.run, Job(store, lm, tuple(files), run_id), config.ingest)
            documents = store.table(docs_art).to_pylist()
            live = live_version(root)
            if is_versioned(root) and live is None:
                raise FleetError(f"{root}: fleet root has versions but no valid 'current' link")
            found = changes(documents, read_manifest(live) if live is not None else None)
            summary: dict[str, Any] = {"kind": NAME, "run_id": run_id, "root": str(root), **found, "trained": [],
                                       "rounds_run": 0, "losses": [], **lm.dtype_record()}
            if only_changed and live is not None and not (found["new"] or found["changed"] or found["removed"]):
                summary.update(version=live.name, published=False, notified={},
                               message=f"nothing changed in {len(found['unchanged'])} documents: "
                                       f"no training, still serving version {live.name}")
                log(summary["message"])
            else:
                target = new_version(root, live if live is not None and not is_versioned(root) else None)
                trains = bool(found["new"] or found["changed"]) or not only_changed
                try:
                    fleet = run_fleet(store, lm, docs, target, config if trains else config.replace(rounds=0),
                                      resume=live is not None, call=call, log=log, fanout=fanout, lock_wait=None)
                except BaseException:
                    discard(target)
                    raise
                call(publish, root, target)
                retention = prune(store, keep, held=[root], protect=[run_id, fleet["run_id"]])
                notified = notify() if notify is not None else {}
                summary.update(
                    version=target.name, published=True, fleet_run_id=fleet["run_id"],
                    trained=[d["name"] for d in fleet["documents"] if d["trained"]],
                    rounds_run=fleet["rounds_run"], losses=fleet["losses"], documents=fleet["documents"],
                    pruned_versions=retention["versions"].get(str(root.resolve()), []),
                    pruned_artifacts=len(retention["artifacts"]), freed_bytes=retention["freed_bytes"],
                    notified=notified,
                    message=(f"published version {target.name}: {len(found['new'])} new, {len(found['changed'])} "
                             f"changed, {len(found['removed'])} removed, {len(found['unchanged'])} unchanged"),
                )
                log(summary["message"])
            summary["seconds"] = time.perf_counter() - started
            write_run_report(store, summary)
            store.catalog.finish_run(run_id, "complete", summary)
            return summary
