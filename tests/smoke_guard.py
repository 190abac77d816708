"""What the smoke preset produces on a tiny model with fixed seeds, as digests.

The guard for refactors: the cartridge pipeline and a fleet, run with the smoke presets
on `tests.tiny.tiny_llama`, must give the same artifacts, rows and files as the recorded
run in `tests/golden/smoke_guard.json`. Rewrite that file (`python -m tests.smoke_guard`)
only for a change meant to alter what the pipeline computes, and say so in the commit.

Two levels, because float sums differ in their last bits between CPU kernels:
- `exact`: a sha256 per artifact over its catalog identity and every file (Parquet rows in
  canonical JSON, other files as bytes); compared when the machine matches the recording's.
- `loose`: per Parquet column, the sha256 of non-float values and the sum and sum of squares
  of float ones; per safetensors tensor, NumPy array and faiss index, its shape and the same
  sums; JSON without the digests of float bytes (checksums, index sha256s). Compared
  everywhere, floats to a relative 1e-4.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import load_file

GOLDEN = Path(__file__).parent / "golden" / "smoke_guard.json"
# Fingerprints hold the paths of inputs (a fleet's directory, a document's path), so every
# run uses this one place; it is emptied before each run.
ROOT = Path("/tmp/cartridges-smoke-guard")
CORPUS = (
    "Prefix caches hold keys and values. A cartridge is trained offline by self-study. "
    "The teacher sees the chunk; the student sees only the cartridge rows. "
) * 12
FLEET_DOCS = {
    "apples.md": "Apples grow on trees in orchards and ripen in the autumn sun. " * 6,
    "rockets.md": "Rockets burn fuel to climb out of the atmosphere into orbit. " * 6,
}
# Digests of float bytes (a safetensors file's metadata; the fleet manifest's own checksum and its
# index files' sha256): loose compares the floats themselves instead.
CHECKSUMS = ("checksum", "header_checksum")
# Wall-clock fields and paths that name the temporary directory.
VOLATILE = {"seconds", "started_at", "finished_at", "created_at", "run_id", "elapsed_s", "wall_s",
            "updated_at", "written_at", "path", "store",
            "threads", "threads_reason"}  # chosen from the cores idle at the start


def machine() -> dict[str, str | int]:
    """What the last bits depend on: the kernels, and the threads that split their sums."""
    return {"capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads()}


def _is_float(t: pa.DataType) -> bool:
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return pa.types.is_floating(t)


def _floats(values: list) -> list[float]:
    out: list[float] = []
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif v is not None:
            out.append(float(v))
    return out


def _sums(xs: list[float]) -> list[float]:
    finite = [x for x in xs if math.isfinite(x)]
    return [len(xs), math.fsum(finite), math.fsum(x * x for x in finite)]


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _floats_out(obj: Any, floats: list[float]) -> Any:
    """`obj` with its floats replaced by a marker, and the floats collected (in order)."""
    if isinstance(obj, dict):
        return {k: _floats_out(v, floats) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_floats_out(v, floats) for v in obj]
    if isinstance(obj, float):
        floats.append(obj)
        return "<float>"
    return obj


def _checksum(key: str) -> bool:
    return key in CHECKSUMS or key.endswith("_sha256")


def _volatile(key: str) -> bool:
    return key in VOLATILE or key.endswith("seconds") or key.endswith("_s")


def _drop(obj: Any, unwanted) -> Any:
    """`obj` without the dict keys that `unwanted` names, at any depth."""
    if isinstance(obj, dict):
        return {k: _drop(v, unwanted) for k, v in obj.items() if not unwanted(k)}
    if isinstance(obj, list):
        return [_drop(v, unwanted) for v in obj]
    return obj


def _strip(obj: Any) -> Any:
    return _drop(obj, _volatile)


def _file_digest(path: Path) -> tuple[str, Any]:
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        table = table.drop_columns([c for c in table.column_names if _volatile(c)])
        rows = table.to_pylist()
        loose = {}
        for name, field in zip(table.column_names, table.schema, strict=True):
            values = table.column(name).to_pylist()
            loose[name] = ("float", _sums(_floats(values))) if _is_float(field.type) else ("exact", _sha(values))
        return _sha(rows), loose
    if path.suffix == ".safetensors":
        # The header's metadata map is written in a per-process order, so the file's bytes
        # differ between identical runs: compare the metadata as a map and each tensor's bytes.
        with safe_open(path, "pt") as handle:
            meta = handle.metadata() or {}
        tensors = load_file(path)
        exact = _sha([meta, [[k, str(v.dtype), list(v.shape), hashlib.sha256(v.contiguous().view(torch.uint8)
                                                                                .numpy().tobytes()).hexdigest()]
                             for k, v in sorted(tensors.items())]])
        loose = {k: [list(v.shape), _sums(v.double().flatten().tolist())] for k, v in sorted(tensors.items())}
        return exact, [loose, ("exact", _sha({k: v for k, v in meta.items() if not _checksum(k)}))]
    if path.suffix == ".json":
        data = _strip(json.loads(path.read_text()))
        floats: list[float] = []
        return _sha(data), [("exact", _sha(_floats_out(_drop(data, _checksum), floats))), ("float", _sums(floats))]
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        return hashlib.sha256(path.read_bytes()).hexdigest(), \
            [("exact", _sha([str(array.dtype), list(array.shape)])), ("float", _sums(array.ravel().tolist()))]
    if path.suffix == ".faiss":
        import faiss

        index = faiss.read_index(str(path))
        vectors = index.reconstruct_n(0, index.ntotal)
        data = path.read_bytes()
        return hashlib.sha256(data).hexdigest(), \
            [("exact", _sha([type(index).__name__, index.d, index.ntotal])), ("float", _sums(vectors.ravel().tolist()))]
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest(), ("exact", hashlib.sha256(data).hexdigest())


def _name(artifact) -> str:
    """The artifact's id, or for a per-run record (a run id in its config) its config's digest."""
    if any(_volatile(k) for k in artifact.config):
        return "config-" + _sha(_strip(artifact.config))[:16]
    return artifact.id


def digest(store_root: Path, extra: dict[str, Path]) -> dict:
    """Digests of every complete artifact in the store and of the named extra directories."""
    from storage import Store

    store = Store(store_root)
    exact: dict[str, str] = {}
    loose: dict[str, Any] = {}
    places = {f"{a.stage}/{_name(a)}|{','.join(a.inputs)}": store.dir(a)
              for a in store.catalog.artifacts() if a.complete}
    places.update({f"extra/{k}": v for k, v in extra.items()})
    for key, directory in sorted(places.items()):
        files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))
        digests = {str(p.relative_to(directory)): _file_digest(p) for p in files}
        exact[key] = _sha({k: v[0] for k, v in digests.items()})
        loose[key] = {k: v[1] for k, v in digests.items()}
    return json.loads(json.dumps({"exact": exact, "loose": loose}))  # as the golden file reads back


def run_smoke(root: Path = ROOT) -> dict:
    """The cartridge pipeline and a two-document fleet on the tiny model, smoke presets."""
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    from jobs.fleet import run_fleet
    from jobs.pipeline import run_pipeline
    from schemas.presets import fleet_preset, preset
    from storage import Store
    from tests.tiny import tiny_llama

    corpus = root / "corpus.md"
    corpus.write_text(CORPUS)
    docs = root / "docs"
    docs.mkdir()
    for name, text in FLEET_DOCS.items():
        (docs / name).write_text(text)
    quiet = lambda _: None  # noqa: E731
    lm = tiny_llama()
    run_pipeline(Store(root / "store"), lm, [corpus], preset("smoke", {"synth": {"filter": False}}))
    run_fleet(Store(root / "store"), lm, [docs], root / "fleet", fleet_preset("smoke"), log=quiet)
    return digest(root / "store", {"fleet": root / "fleet"})


def close(a: Any, b: Any, rel: float = 1e-4, where: str = "") -> list[str]:
    """Where two loose digests differ (floats compared to `rel`)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}/{k}: only in one" for k in set(a) ^ set(b)]
        for k in sorted(set(a) & set(b)):
            out += close(a[k], b[k], rel, f"{where}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        if len(a) == 2 and a[0] == "float":
            return close(a[1], b[1], rel, where)
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += close(x, y, rel, f"{where}[{i}]")
        return out
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=rel, abs_tol=1e-6) else [f"{where}: {a} != {b}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


if __name__ == "__main__":
    result = run_smoke()
    GOLDEN.write_text(json.dumps({"machine": machine(), **result}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({len(result['exact'])} artifacts)", file=sys.stderr)
