"""The GPU check: the engine's correctness on the device and its speed at real shapes, in one run.

Runs under a bare machine's own `python3` (torch, transformers, safetensors, pyarrow,
tqdm; no Prefect, DuckDB, faiss or gguf) with the repository on PYTHONPATH, offline:

1. correctness on the tiny models (tests/tiny.py, Llama and Qwen3): the equivalence
   gate, finite-difference and training-gradient checks, one and two parts, float32
   and bfloat16 (bench/gpu/correct.py);
2. per model shape (SmolLM2-135M, Qwen3-0.6B, Llama-3.2-1B; configs in
   bench/gpu/configs/, random weights, bfloat16): the gate at that shape, self-study
   conversations per second, time to first token behind a cartridge against the
   document in the prompt, and decode throughput at 1 and 16 streams
   (bench/gpu/speed.py).

Writes `gpu_check.json` (the summary, rewritten after every section) and
`gpu_check.log` into --out. Sections that would start after --budget-s are skipped.
Exit status: 0 all passed, 1 a check failed or a section broke, 2 no usable device.

    python3 -m bench.gpu_check                         # on the GPU, real shapes
    python3 -m bench.gpu_check --device cpu --tiny     # the dry run: same code, toy sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUMMARY, LOG = "gpu_check.json", "gpu_check.log"


class Log:
    """Lines to stdout and to the log file; tracebacks to the log file only."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w", encoding="utf-8")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def detail(self, text: str) -> None:
        self.file.write(text if text.endswith("\n") else text + "\n")
        self.file.flush()


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


class Run:
    """Sections with a time budget; the summary is written after each one."""

    def __init__(self, out: Path, log: Log, budget_s: float, summary: dict, start: float) -> None:
        self.out, self.log, self.summary = out, log, summary
        self.start = start  # when the process began its work, imports included
        self.deadline = self.start + budget_s

    def write(self) -> None:
        self.summary["seconds"] = round(time.perf_counter() - self.start, 1)
        tmp = self.out / (SUMMARY + ".tmp")
        tmp.write_text(json.dumps(self.summary, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.out / SUMMARY)

    def section(self, name: str, fn):
        entry = {"name": name, "status": "skipped", "seconds": 0.0}
        self.summary["sections"].append(entry)
        if time.perf_counter() > self.deadline:
            self.log(f"-- {name}: skipped (past the time budget)")
            self.write()
            return None
        self.log(f"-- {name}")
        t0 = time.perf_counter()
        result = None
        try:
            result = fn()
            entry["status"] = "ok"
        except Exception as exc:  # one section's failure must not lose the others' figures
            entry["status"], entry["error"] = "error", one_line(exc)
            self.log(f"   error: {one_line(exc)} (traceback in {LOG})")
            self.log.detail(traceback.format_exc())
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        self.write()
        return result


def environment(torch, device) -> dict:
    import transformers

    env = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "device": str(device), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    else:
        env["gpu"] = None
    return env


def pick_device(torch, name: str):
    """The device, or None with the reason when it cannot be used."""
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            return None, (f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none; "
                          "this check needs a GPU (for the CPU dry run: --device cpu --tiny)")
        return torch.device(name), None
    if name != "cpu":
        return None, f"--device {name}: use cuda, cuda:N or cpu"
    return torch.device("cpu"), None


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for the dry run")
    ap.add_argument("--tiny", action="store_true", help="toy sizes of every model and step (the CPU dry run)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="folder for the JSON and the log")
    ap.add_argument("--models", nargs="*", default=None, help="model shapes (default: all in bench/gpu/configs)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="for the model shapes")
    ap.add_argument("--budget-s", type=float, default=360.0, help="start no section after this many seconds")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--json", action="store_true", help="end with the summary as one JSON line")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch
    except Exception as exc:
        print(f"error: cannot import torch ({one_line(exc)})", file=sys.stderr)
        return 2
    device, reason = pick_device(torch, args.device)
    if device is None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / LOG)
    try:
        return check(args, torch, device, out, log, start)
    except Exception as exc:  # a failure outside any section (imports): one line here, the rest in the log
        log(f"error: {one_line(exc)} (traceback in {out / LOG})")
        log.detail(traceback.format_exc())
        return 1


def check(args: argparse.Namespace, torch, device, out: Path, log: Log, start: float) -> int:
    from bench.gpu import correct, shapes, speed
    from cartridges.evaluation.equiv import equivalence

    sizes = speed.tiny_sizes() if args.tiny else speed.full_sizes()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    models = args.models or list(shapes.MODELS)
    summary: dict = {
        "check": "gpu_check", "mode": "tiny" if args.tiny else "full", "dtype": args.dtype,
        "environment": environment(torch, device), "sizes": vars(sizes), "sections": [], "correct": [],
        "models": {}, "pass": False,
    }
    run = Run(out, log, args.budget_s, summary, start)
    env = summary["environment"]
    log(f"GPU check ({summary['mode']}): {env['gpu'] or 'CPU'} on {env['device']}, python {env['python']}, "
        f"torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}")
    run.write()

    text = (REPO / "docs" / "corpus" / "deflate.md").read_text(encoding="utf-8")
    gate_p, gate_suffix = (32, 16) if args.tiny else (128, 64)

    def correctness() -> None:
        for row in correct.all_checks(device, text, gate_p, gate_suffix):
            summary["correct"].append(row)
            log("   " + describe(row))

    run.section("correctness (tiny models)", correctness)

    for name in models:
        result: dict = {}
        summary["models"][name] = result
        lm = run.section(f"{name}: build", lambda name=name: shapes.build(name, device, dtype, tiny=args.tiny))
        if lm is None:
            continue
        result["parameters"] = shapes.parameters(lm)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def shape_gate(lm=lm, result=result, name=name) -> None:
            result["gate"] = []
            gen = torch.Generator().manual_seed(3)
            lm.tokenizer = shapes.IdTokenizer(shapes.random_ids(2 * sizes.gate_p + sizes.gate_suffix,
                                                                lm.model.config.vocab_size, gen))
            for parts in (1, 2):
                r = equivalence(lm, "", p=sizes.gate_p, suffix_max=sizes.gate_suffix, parts=parts)
                row = {"check": "gate", "model": name, "dtype": args.dtype, "parts": parts, "informational": True,
                       **{k: r[k] for k in ("p", "n", "max_abs_dlogit", "tolerance", "own_shape_sensitivity",
                                            "greedy_agree", "greedy_ties", "pass")}}
                result["gate"].append(row)
                log("   " + describe(row))

        def warm(lm=lm) -> None:
            small = speed.warmup_sizes(sizes)
            speed.selfstudy(lm, small)
            speed.ttft(lm, small)
            speed.decode(lm, small)

        def measure(key: str, fn, lm=lm, result=result) -> None:
            result[key] = fn(lm, sizes)
            log("   " + ", ".join(f"{k} {v}" for k, v in result[key].items()))

        run.section(f"{name}: gate at this shape", shape_gate)
        run.section(f"{name}: warm-up", warm)
        run.section(f"{name}: self-study", lambda measure=measure: measure("selfstudy", speed.selfstudy))
        run.section(f"{name}: time to first token", lambda measure=measure: measure("ttft", speed.ttft))
        run.section(f"{name}: decode", lambda measure=measure: measure("decode", speed.decode))
        if device.type == "cuda":
            result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        del lm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # The gate at the real shapes is reported, not judged: their random logits reach about 1,
    # where one bfloat16 step of the output (about 4e-3) exceeds the gate's 1e-3 floor, and
    # where two real prefills of different lengths agree bit for bit the yardstick is zero.
    # The tiny models' gates (section one) are the verdict.
    checks = summary["correct"]
    broken = [s["name"] for s in summary["sections"] if s["status"] != "ok"]
    summary["failed_checks"] = sum(not row["pass"] for row in checks)
    summary["pass"] = bool(checks) and summary["failed_checks"] == 0 and not broken
    run.write()
    for line in report(summary, sizes):
        log(line)
    verdict = "PASS" if summary["pass"] else "FAIL"
    log(f"{verdict}: {len(checks) - summary['failed_checks']}/{len(checks)} checks passed, "
        f"{len(broken)} sections not run or broken{': ' + '; '.join(broken) if broken else ''}; "
        f"{summary['seconds']:.0f} s; {out / SUMMARY}")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["pass"] else 1


def describe(row: dict) -> str:
    head = f"{row['check']:<18} {row['model']:<13} {row['dtype']:<8} parts {row['parts']}"
    verdict = ("PASS" if row["pass"] else "FAIL") + (" (reported, not judged)" if row.get("informational") else "")
    if row["check"] == "gate":
        own = row["own_shape_sensitivity"]
        bound = row["tolerance"] if row.get("scaled_tolerance") is None else min(row["tolerance"], row["scaled_tolerance"])
        return (f"{head}  max|dlogit| {row['max_abs_dlogit']:.2e} <= {bound:.2e}"
                f"{'' if own is None else f' (own {own:.2e})'}, greedy {row['greedy_agree']}/{row['n']}"
                f" (ties {row['greedy_ties']})  {verdict}")
    if row["check"] == "gradients":
        return (f"{head}  rel err packed {row['rel_error_packed']:.2e} flat {row['rel_error_flat']:.2e}"
                f" <= {row['tolerance']:.2e}, packed vs flat {row['packed_vs_flat']:.2e}  {verdict}")
    return (f"{head}  gradcheck; directional {row['directional_analytic']:.6g} vs {row['directional_numeric']:.6g}"
            f" (rel {row['rel_error']:.1e})  {verdict}")


def report(summary: dict, sizes) -> list[str]:
    """The throughput figures of every model side by side."""
    cols = [
        ("params", lambda m: f"{m['parameters'] / 1e6:.1f}M"),
        ("conv/s", lambda m: m["selfstudy"]["conversations_per_s"]),
        ("+teacher", lambda m: m["selfstudy"]["conversations_per_s_with_teacher_pass"]),
        ("gen tok/s", lambda m: m["selfstudy"]["generate_tokens_per_s"]),
        ("train tok/s", lambda m: m["selfstudy"]["train_tokens_per_s"]),
        ("TTFT doc ms", lambda m: m["ttft"]["ttft_icl_ms"]),
        ("TTFT cart ms", lambda m: m["ttft"]["ttft_cartridge_ms"]),
        ("TTFT ratio", lambda m: f"{m['ttft']['ttft_ratio']}x"),
        ("dec tok/s 1", lambda m: m["decode"]["decode_tokens_per_s_1"]),
        (f"dec tok/s {sizes.streams}", lambda m: m["decode"][f"decode_tokens_per_s_{sizes.streams}"]),
        (f"{sizes.streams}/1", lambda m: f"{m['decode']['concurrency_ratio']}x"),
        ("peak GiB", lambda m: m.get("peak_memory_gib", "-")),
    ]

    def cell(fn, m) -> str:
        try:
            return str(fn(m))
        except KeyError:
            return "-"

    rows = [["model"] + [c for c, _ in cols]]
    rows += [[name] + [cell(fn, m) for _, fn in cols] for name, m in summary["models"].items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["", f"self-study: {sizes.conversations} conversations, chunks {sizes.chunk_min}-{sizes.chunk_max} tokens, "
             f"{sizes.per_chunk} per chunk, generation width {sizes.gen_batch}, questions {sizes.max_q} and answers "
             f"{sizes.max_a} tokens, p {sizes.p}, groups of {sizes.accum}; TTFT: a {sizes.doc_tokens}-token document "
             f"in the prompt vs its {sizes.p}-row cartridge; decode: {sizes.decode_new} new tokens per stream, "
             f"{summary['dtype']}"]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return lines


if __name__ == "__main__":
    sys.exit(main())
