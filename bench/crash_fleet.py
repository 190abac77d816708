"""Kill the tiny-model fleet flow at every named fault point and check each rerun against a clean run.

For each point of `tests/test_crash.py:KILL_POINTS`: run `cartridges fleet` (tiny random
Llama, smoke preset, 6 rounds, 3 documents) in a child process with
`CARTRIDGES_FAULT=<point>` (SIGKILL there), check the store right after the kill, rerun
the command as a user would (`--resume` when a manifest exists, the missing rounds), and
compare every fleet file, the content-keyed artifacts and the train_steps rows with those
of an uninterrupted run. Prints a table; `--json` adds one JSON object as the last line.
Run: `python -m bench.crash_fleet [--only POINT ...] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="fault points to try (default: all)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)

    from tests.crash import check_store, compare, fleet_argv, rerun, run_cli
    from tests.test_crash import KILL_POINTS, ROUNDS
    from tests.test_fleet_run import write_docs
    from tests.tiny import tiny_llama

    work = Path(tempfile.mkdtemp(prefix="crash-fleet-"))
    lm = tiny_llama()
    model = work / "tiny"
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    docs = write_docs(work / "docs")
    assert run_cli(fleet_argv(model, docs, work / "clean", ROUNDS), work / "clean.log") == 0
    points = [k for k in KILL_POINTS if args.only is None or k[0] in args.only]
    results = []
    for fault, where in points:
        crashed = work / "crashed"
        started = time.perf_counter()
        code = run_cli(fleet_argv(model, docs, crashed, ROUNDS), work / "crash.log", fault=fault)
        problems = [] if code == -9 else [f"not killed (exit {code})"]
        try:
            if (crashed / "store" / "catalog.duckdb").exists():
                check_store(crashed / "store")
        except AssertionError as exc:
            problems.append(f"after the kill: {exc}")
        code = rerun(model, docs, crashed, ROUNDS)
        if code != 0:
            problems.append(f"rerun exit {code}")
        else:
            problems += compare(work / "clean", crashed, ROUNDS)
        results.append({"point": fault, "where": where, "survived": not problems, "problems": problems,
                        "seconds": round(time.perf_counter() - started, 1)})
        shutil.rmtree(crashed, ignore_errors=True)
        print(f"{fault:<38} {'ok' if not problems else 'FAIL: ' + '; '.join(problems)}  "
              f"({results[-1]['seconds']} s)  {where}", flush=True)
    survived = sum(r["survived"] for r in results)
    print(f"\nkill points tried: {len(results)}, survived: {survived}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"kill_points": len(results), "survived": survived, "results": results}))
    return 0 if survived == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
