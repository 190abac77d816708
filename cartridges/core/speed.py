"""Speed settings chosen on the machine at hand, never from a constant.

bfloat16 weights run 1.5-3.9x faster than float32 on a CPU with native bfloat16
(AVX512-BF16, AMX) and about 55x slower on one without (AVX2 only), where torch
emulates it. So `--dtype auto` takes float32 on CPUs whose capability rules bfloat16
out, and elsewhere times the model's own matmul shape in both dtypes, once per
machine (cached under `$XDG_CACHE_HOME/cartridges/`), choosing bfloat16 only when it
is clearly faster. bfloat16 cartridges score within noise of float32
(docs/BENCHMARKS.md), so speed alone decides.

Threads follow the cores that are free when a command starts: of the cores this process
may run on (its CPU affinity), those that sat idle over a short sample of `/proc/stat`.
torch's default, one thread per core, loses badly when another process keeps a core busy:
every parallel step then waits for the thread that shares that core (on a 2-core machine
with one core busy, scoring ran 2.7x slower with 2 threads than with 1).
`CARTRIDGES_THREADS` (or `OMP_NUM_THREADS`) fixes the count instead.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from storage.atomic import write_json_atomic

# bfloat16 must beat float32 by this factor: a tie is not worth the rounding.
MIN_SPEEDUP = 1.2
# torch's CPU capabilities whose kernels have no native bfloat16 path.
NO_BF16_CAPABILITIES = ("DEFAULT", "NO AVX", "AVX", "AVX2", "VSX", "ZVECTOR")
PROBE_ROWS = 64
THREADS_ENV = "CARTRIDGES_THREADS"
IDLE_SAMPLE_S = 0.15
_threads_reason = "torch's default: one thread per core"


def dtype_name(dtype: torch.dtype) -> str:
    """The name `--dtype` takes and records carry ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    def record(self) -> dict:
        """What a run summary and `--json` carry."""
        return {"dtype": dtype_name(self.dtype), "dtype_reason": self.reason}


def cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_id() -> str:
    """This machine as its speeds depend on it. A host name alone is not enough: a virtual
    machine can keep its name while the CPU under it changes."""
    return f"{platform.node()} | {cpu_name()} | {cpu_capability()} | {os.cpu_count()} cpus | torch {torch.__version__}"


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cartridges" / "speed.json"


def _seconds(a: torch.Tensor, b: torch.Tensor, reps: int) -> float:
    torch.mm(a, b)  # warm-up: first calls pay for kernel selection
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def probe_bf16_speedup(shape: tuple[int, int], reps: int = 5) -> float:
    """float32 time over bfloat16 time for a [PROBE_ROWS, d] x [d, f] matmul (best of `reps`)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(PROBE_ROWS, shape[0], generator=gen)
    b = torch.randn(shape[0], shape[1], generator=gen)
    f32 = _seconds(a, b, reps)
    bf16 = _seconds(a.bfloat16(), b.bfloat16(), reps)
    return f32 / max(bf16, 1e-9)


def _cached_speedup(shape: tuple[int, int]) -> tuple[float, bool]:
    """The measured speed-up for this machine, torch and thread count; measured on a miss."""
    key = f"{cpu_name()} | {cpu_capability()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {shape[0]}x{shape[1]}"
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache, dict) and isinstance(cache.get(key), int | float):
        return float(cache[key]), True
    speedup = probe_bf16_speedup(shape)
    cache = cache if isinstance(cache, dict) else {}
    cache[key] = round(speedup, 3)
    try:  # a cache that cannot be written only costs the next run the probe
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, cache)
    except OSError:
        pass
    return speedup, False


def choose_dtype(device: torch.device, shape: tuple[int, int]) -> DtypeChoice:
    """The fastest dtype for a model whose main matmul is [*, shape[0]] x [shape[0], shape[1]]."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "cuda device with bfloat16 support")
        return DtypeChoice(torch.float32, "cuda device without bfloat16 support")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"{device.type} device: float32")
    capability = cpu_capability()
    if capability in NO_BF16_CAPABILITIES:
        return DtypeChoice(torch.float32, f"CPU capability {capability}: no native bfloat16")
    speedup, cached = _cached_speedup(shape)
    where = "cached probe" if cached else "probe"
    measured = f"bfloat16 {speedup:.2f}x float32 on [{PROBE_ROWS},{shape[0]}]x[{shape[0]},{shape[1]}] " \
               f"({where}, CPU {capability}, {torch.get_num_threads()} threads)"
    if speedup >= MIN_SPEEDUP:
        return DtypeChoice(torch.bfloat16, measured)
    return DtypeChoice(torch.float32, measured + f"; float32 unless bfloat16 is {MIN_SPEEDUP}x faster")


def model_shape(config: object) -> tuple[int, int]:
    """The model's own largest matmul shape (hidden -> MLP width), for the probe."""
    hidden = int(getattr(config, "hidden_size", 0) or 512)
    inner = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    return hidden, inner


def idle_cores(cpus: list[int], window: float = IDLE_SAMPLE_S, stat: Path = Path("/proc/stat")) -> float | None:
    """How many of `cpus` sat idle over `window` seconds (idle and iowait time in `/proc/stat`);
    None where the file cannot be read."""
    def sample() -> dict[int, tuple[int, int]]:
        out = {}
        for line in stat.read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks = [int(x) for x in fields[:8]]
                out[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])
        return out
    try:
        before = sample()
        time.sleep(window)
        after = sample()
    except (OSError, ValueError):
        return None
    idle = 0.0
    for cpu, (total, free) in after.items():
        total0, free0 = before.get(cpu, (total, free))
        idle += (free - free0) / (total - total0) if total > total0 else 1.0  # no ticks counted: idle
    return idle if after else None


def choose_threads() -> tuple[int, str]:
    """Set torch's thread count for this command from the cores free now (module docstring)."""
    global _threads_reason
    if os.environ.get(THREADS_ENV):
        value = os.environ[THREADS_ENV]
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{THREADS_ENV}={value!r}: must be a whole number of threads, at least 1")
        n, reason = int(value), f"{THREADS_ENV}={value}"
    elif os.environ.get("OMP_NUM_THREADS"):
        n, reason = torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    else:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        idle = idle_cores(cpus)
        if idle is None:
            n, reason = len(cpus), f"{len(cpus)} cores this process may use"
        else:
            n = max(1, min(len(cpus), round(idle)))
            reason = f"{idle:.1f} of the {len(cpus)} cores this process may use were idle at start"
    torch.set_num_threads(n)
    _threads_reason = reason
    return n, reason


def threads_record() -> dict:
    """What a run summary and `--json` carry about threads."""
    return {"threads": torch.get_num_threads(), "threads_reason": _threads_reason}
