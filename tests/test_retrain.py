"""Retraining a published fleet: only what changed trains, versions switch atomically, servers hear of it."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading

import pytest

from cartridges.fleet import Fleet
from cartridges.fleet.manifest import read_manifest
from jobs.fleet import run_fleet
from jobs.retrain import notify_reload, retrain_config, run_retrain
from schemas.presets import fleet_preset
from storage import Store, query
from storage.versions import current, new_version, prune_versions, publish
from tests.test_fleet_run import quiet, write_docs
from tests.tiny import tiny_llama


@pytest.fixture(scope="module")
def lm():
    return tiny_llama()


def snapshot(directory):
    """Every file of a version: name -> bytes."""
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_retrain_trains_exactly_the_edited_and_added_documents_and_retires_the_removed(tmp_path, lm):
    docs, root, store = write_docs(tmp_path / "docs"), tmp_path / "fleet", Store(tmp_path / "s")
    cfg = fleet_preset("smoke")
    calls = []

    def notify():
        calls.append(1)
        return {"fake": True}

    first = run_retrain(store, lm, [docs], root, cfg, log=quiet, notify=notify)
    assert first["published"] and first["version"] == "0001" and sorted(first["new"]) == ["d0.md", "d1.md", "d2.md"]
    v1 = current(root)
    assert v1 == (root / "versions" / "0001").resolve()
    before, steps = snapshot(v1), {d.name: d.steps for d in read_manifest(v1).documents}

    same = run_retrain(store, lm, [docs], root, cfg, log=quiet, notify=notify)
    assert same["trained"] == [] and same["rounds_run"] == 0 and not same["published"]
    assert "nothing changed" in same["message"] and "no training" in same["message"]
    assert current(root) == v1 and not (root / "versions" / "0002").exists() and snapshot(v1) == before
    assert len(calls) == 1

    (docs / "d1.md").write_text("clocks keep the time. " * 20)
    (docs / "d2.md").unlink()
    (docs / "d3.md").write_text("bread needs flour and yeast. " * 20)
    s = run_retrain(store, lm, [docs], root, cfg, log=quiet, notify=notify)
    assert (s["changed"], s["new"], s["removed"], s["unchanged"]) == (["d1.md"], ["d3.md"], ["d2.md"], ["d0.md"])
    assert sorted(s["trained"]) == ["d1.md", "d3.md"] and s["rounds_run"] == cfg.rounds
    assert s["published"] and s["version"] == "0002" and len(calls) == 2
    v2 = current(root)
    assert v2 == (root / "versions" / "0002").resolve()
    m = read_manifest(v2)
    assert [d.name for d in m.documents] == ["d0.md", "d1.md", "d3.md"]
    d0 = m.entry("d0.md")
    after = snapshot(v2)
    assert d0.steps == steps["d0.md"]
    assert after[d0.cartridge] == before[d0.cartridge] and after[d0.optimizer] == before[d0.optimizer]
    assert not [n for n in after if n.startswith("doc-002")]  # the removed document's files are gone
    assert snapshot(v1) == before  # the old version stays whole for readers that still use it
    assert Fleet.open(root, lm).names == ["d0.md", "d1.md", "d3.md"]
    assert set(Fleet.open(root, lm).index().chunk_docs) == {"d0.md", "d1.md", "d3.md"}

    again = run_retrain(store, lm, [docs], root, cfg, log=quiet, notify=notify)
    assert again["trained"] == [] and current(root) == v2 and len(calls) == 2
    _, rows = query(store.root, "SELECT flow, status FROM runs WHERE flow = 'retrain' ORDER BY started_at")
    assert rows == [("retrain", "complete")] * 4
    report = (store.root / "runs" / s["run_id"] / "summary.md").read_text()
    assert "d1.md, d3.md" in report and "skipped as unchanged: d0.md" in report
    assert (store.root / "runs" / s["run_id"] / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "nothing changed" in (store.root / "runs" / again["run_id"] / "summary.md").read_text()


def test_only_a_removal_retrains_nothing_and_rebuilds_the_index(tmp_path, lm):
    docs, root, store = write_docs(tmp_path / "docs"), tmp_path / "fleet", Store(tmp_path / "s")
    cfg = fleet_preset("smoke")
    run_retrain(store, lm, [docs], root, cfg, log=quiet)
    before = snapshot(current(root))
    (docs / "d2.md").unlink()
    s = run_retrain(store, lm, [docs], root, cfg, log=quiet)
    assert s["trained"] == [] and s["rounds_run"] == 0 and s["removed"] == ["d2.md"] and s["version"] == "0002"
    m = read_manifest(current(root))
    for e in m.documents:
        assert snapshot(current(root))[e.cartridge] == before[e.cartridge]
    assert set(Fleet.open(root, lm).index().chunk_docs) == {"d0.md", "d1.md"}


def test_a_fleet_directory_built_by_the_fleet_command_becomes_the_first_version(tmp_path, lm):
    docs, store = write_docs(tmp_path / "docs"), Store(tmp_path / "s")
    cfg = fleet_preset("smoke")
    run_fleet(store, lm, [docs], tmp_path / "f", cfg, log=quiet)
    assert retrain_config(tmp_path / "f").to_dict() == cfg.to_dict()  # the fleet's own config by default
    before = snapshot(tmp_path / "f")
    (docs / "d0.md").write_text("clocks keep the time. " * 20)
    s = run_retrain(store, lm, [docs], tmp_path / "f", retrain_config(tmp_path / "f"), log=quiet)
    assert s["trained"] == ["d0.md"] and s["version"] == "0001"
    m = read_manifest(current(tmp_path / "f"))
    for name in ("d1.md", "d2.md"):
        assert snapshot(current(tmp_path / "f"))[m.entry(name).cartridge] == before[m.entry(name).cartridge]


def test_current_switches_by_rename_so_a_reader_never_sees_no_version(tmp_path, monkeypatch):
    root = tmp_path / "root"
    v1 = new_version(root)
    (v1 / "a.txt").write_text("one")
    publish(root, v1)
    v2 = new_version(root)
    assert os.stat(v2 / "a.txt").st_ino == os.stat(v1 / "a.txt").st_ino  # hard-linked, not rewritten
    seen = []
    real = os.replace

    def watch(src, dst):
        seen.append((os.path.islink(dst), os.readlink(dst) if os.path.islink(dst) else None))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", watch)
    publish(root, v2)
    assert seen == [(True, "versions/0001")]  # the old link stood until the rename replaced it
    assert os.readlink(root / "current") == "versions/0002" and current(root) == v2.resolve()
    monkeypatch.undo()
    for _ in range(3):
        publish(root, new_version(root))
    assert prune_versions(root, keep=3) == ["0001", "0002"]
    assert current(root).name == "0005"


class _Stub(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        body = json.dumps({"status": "reloaded", "version": 2}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_reload_is_posted_with_the_api_key_and_an_unreachable_server_is_a_warning(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        lines = []
        out = notify_reload(url, api_key="sekret", log=lines.append)
        assert _Stub.seen == [("/admin/reload", "Bearer sekret")] and out["http"]["status"] == 200
    finally:
        server.shutdown()
        server.server_close()
    lines = []
    out = notify_reload(url, api_key="sekret", log=lines.append, timeout=2)
    assert "error" in out["http"] and lines and lines[0].startswith("warning: could not reach")


def test_reload_by_sighup_signals_the_pid_in_the_file(tmp_path):
    got = []
    old = signal.signal(signal.SIGHUP, lambda *_: got.append(1))
    try:
        (tmp_path / "serve.pid").write_text(f"{os.getpid()}\n")
        out = notify_reload(pid_file=tmp_path / "serve.pid", log=quiet)
    finally:
        signal.signal(signal.SIGHUP, old)
    assert got == [1] and out["sighup"]["pid"] == os.getpid()
    lines = []
    notify_reload(pid_file=tmp_path / "missing.pid", log=lines.append)
    assert lines[0].startswith("warning: could not signal")
