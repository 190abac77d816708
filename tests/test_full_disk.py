"""A real full disk: the store and the fleet on a small tmpfs that fills up during a fleet run,
during a cartridge's synthesis or training checkpoint, and during a fleet publish.

One line naming the file that could not be written, complete artifacts whole, and after the
filesystem grows (space freed) the rerun reaches exactly the uninterrupted run's results.
Needs `mount` (root, or CAP_SYS_ADMIN): skipped with the reason where mounting is not allowed.
"""

from __future__ import annotations

import subprocess

import pytest

from storage.faults import FILL_ENV
from storage.retention import tree_bytes
from tests.crash import (
    check_store,
    compare,
    fleet_argv,
    fleet_state,
    rerun,
    run_cli,
    safetensors_contents,
)
from tests.test_crash import ROUNDS
from tests.test_fleet_run import write_docs

pytestmark = pytest.mark.reliability


def mount(directory, kib: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(directory)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or done.returncode}): "
                    "the full-disk test needs root or CAP_SYS_ADMIN")


@pytest.mark.parametrize("fraction", [0.6, 0.9])
def test_a_fleet_run_on_a_full_filesystem_fails_with_one_line_and_resumes_once_space_is_freed(
        tmp_path, tiny_model_dir, fraction):
    docs = write_docs(tmp_path / "docs")
    code = run_cli(fleet_argv(tiny_model_dir, docs, tmp_path / "clean", ROUNDS), tmp_path / "clean.log")
    assert code == 0, (tmp_path / "clean.log").read_text()[-3000:]
    need = tree_bytes(tmp_path / "clean")
    disk = tmp_path / "disk"
    mount(disk, int(need * fraction) // 1024)
    try:
        code = run_cli(fleet_argv(tiny_model_dir, docs, disk, ROUNDS), tmp_path / "full.log")
        out = (tmp_path / "full.log").read_text(errors="replace")
        last = out.strip().splitlines()[-1]
        assert code == 2 and "Traceback" not in out, out[-3000:]
        assert last.startswith(f"error: [Errno 28] No space left on device: '{disk}/"), last
        assert last.endswith("(disk full: free space and rerun the command; finished work is kept)")
        if (disk / "store" / "catalog.duckdb").exists():
            check_store(disk / "store")
        subprocess.run(["mount", "-o", f"remount,size={4 * need // 1024}k", str(disk)], check=True)  # space freed
        code = rerun(tiny_model_dir, docs, disk, ROUNDS)
        assert code == 0, (disk / "rerun.log").read_text()[-3000:]
        assert compare(tmp_path / "clean", disk, ROUNDS) == []
        print(f"full at {fraction:.0%} of {need} bytes: {last}")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# Full at a chosen step: the `fill` fault point fills the filesystem there (a file of zeros on the
# tmpfs), so the run's next write meets a real ENOSPC; deleting the file frees the space.
FILL_MIB = 64


def fills_at(point: str, disk) -> tuple[str, dict[str, str]]:
    return f"{point}:fill", {FILL_ENV: str(disk / "filler")}


def full_line(log, disk) -> str:
    out = log.read_text(errors="replace")
    assert "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: [Errno 28] No space left on device") and str(disk) in last, last
    assert last.endswith("(disk full: free space and rerun the command; finished work is kept)"), last
    return last


def train_argv(model, corpus, store) -> list[str]:
    return ["train", "--corpus", str(corpus), "--model", str(model), "--store", str(store), "--preset", "smoke",
            "--no-filter", "--save-every", "1", "--save", str(store.parent / "out.safetensors"), "--no-prefect"]


@pytest.mark.parametrize("point", ["synthesize.shard.0", "train.step.0"])
def test_a_cartridge_run_that_fills_the_disk_mid_synthesis_or_mid_checkpoint_resumes_to_the_same_cartridge(
        tmp_path, tiny_model_dir, point):
    corpus = tmp_path / "corpus.md"
    corpus.write_text("Prefix caches hold keys and values. A cartridge is trained offline by self-study. " * 24)
    clean = tmp_path / "clean" / "store"
    assert run_cli(train_argv(tiny_model_dir, corpus, clean), tmp_path / "clean.log") == 0, \
        (tmp_path / "clean.log").read_text()[-3000:]
    disk = tmp_path / "disk"
    mount(disk, FILL_MIB * 1024)
    try:
        fault, env = fills_at(point, disk)
        code = run_cli(train_argv(tiny_model_dir, corpus, disk / "store"), tmp_path / "full.log", fault, env=env)
        assert code == 2
        last = full_line(tmp_path / "full.log", disk)
        stages = check_store(disk / "store")  # every complete artifact whole
        assert "train" not in stages  # the stage that met the full disk is not complete
        (disk / "filler").unlink()  # space freed
        code = run_cli(train_argv(tiny_model_dir, corpus, disk / "store"), tmp_path / "rerun.log")
        assert code == 0, (tmp_path / "rerun.log").read_text()[-3000:]
        got, want = safetensors_contents(disk / "out.safetensors"), safetensors_contents(clean.parent / "out.safetensors")
        assert got[1] == want[1], "tensors differ"
        assert got[0] == want[0], {k: (got[0].get(k), want[0].get(k)) for k in set(got[0]) | set(want[0]) if got[0].get(k) != want[0].get(k)}
        print(f"full at {point}: {last}")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def retrain_argv(model, docs, root) -> list[str]:
    return ["retrain", "--docs", str(docs), "--model", str(model), "--fleet", str(root / "fleet"),
            "--store", str(root / "store"), "--preset", "smoke"]


def test_a_publish_that_fills_the_disk_keeps_the_live_version_served_and_resumes(tmp_path, tiny_model_dir):
    from cartridges.core.models import load_model
    from cartridges.fleet import Fleet

    docs = write_docs(tmp_path / "docs")
    (docs / "a.md").write_text("Apricots dry in the sun on wide racks. " * 8)  # a first version of one document
    disk = tmp_path / "disk"
    mount(disk, FILL_MIB * 1024)
    try:
        assert run_cli(retrain_argv(tiny_model_dir, docs, disk), tmp_path / "v1.log") == 0, \
            (tmp_path / "v1.log").read_text()[-3000:]
        live = (disk / "fleet" / "current").resolve()
        before = fleet_state(live)
        (docs / "a.md").write_text("Apricots dry in the sun on wide racks, then go to market. " * 8)
        fault, env = fills_at("fleet.publish.manifest", disk)
        assert run_cli(retrain_argv(tiny_model_dir, docs, disk), tmp_path / "full.log", fault, env=env) == 2
        last = full_line(tmp_path / "full.log", disk)
        assert (disk / "fleet" / "current").resolve() == live and fleet_state(live) == before
        lm = load_model(str(tiny_model_dir))
        assert Fleet.open(disk / "fleet" / "current", lm).names  # still opens, checksums and all
        check_store(disk / "store")
        (disk / "filler").unlink()  # space freed
        assert run_cli(retrain_argv(tiny_model_dir, docs, disk), tmp_path / "rerun.log") == 0, \
            (tmp_path / "rerun.log").read_text()[-3000:]
        published = (disk / "fleet" / "current").resolve()
        assert published != live and published.name == "0002"
        # the same two publishes with no full disk in between give the same fleet
        clean = tmp_path / "clean"
        (docs / "a.md").write_text("Apricots dry in the sun on wide racks. " * 8)
        assert run_cli(retrain_argv(tiny_model_dir, docs, clean), tmp_path / "c1.log") == 0
        (docs / "a.md").write_text("Apricots dry in the sun on wide racks, then go to market. " * 8)
        assert run_cli(retrain_argv(tiny_model_dir, docs, clean), tmp_path / "c2.log") == 0
        assert fleet_state(published) == fleet_state((clean / "fleet" / "current").resolve())
        print(f"full at publish: {last}; still serving {live.name}")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
