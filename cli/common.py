"""What every command shares: the registry, the common flags, and the --json contract."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from cartridges.core.errors import CartridgeError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn

    return register


def emit_json(args: argparse.Namespace, obj: dict) -> None:
    """With --json, the last printed line is one JSON object."""
    if getattr(args, "json", False):
        print(json.dumps(obj, default=str), flush=True)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="packaged name (smollm2, gemma3-270m), model dir, .gguf file, or cached hub id "
                        "(default: smollm2, SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when present)")
    parser.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights and activations (default auto: the fastest on this machine; bfloat16 on a "
                             "cuda device that supports it and on a CPU where a cached probe measures it faster, "
                             "else float32); cartridge rows and optimizer state stay float32")


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def add_runner_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task-runner", choices=("local", "dask"), default="local",
                        help="where shards and per-document work run: this process (side by side on its cores, one thread each), or Dask workers (prefect-dask)")
    parser.add_argument("--dask-address", default=None,
                        help="scheduler of an existing Dask cluster, tcp://HOST:PORT (default: a local cluster)")


def check_runner(args: argparse.Namespace) -> None:
    if args.no_prefect and (args.task_runner != "local" or args.dask_address):
        raise CartridgeError("--task-runner dask runs through Prefect; drop --no-prefect")
    if args.dask_address and args.task_runner != "dask":
        raise CartridgeError("--dask-address needs --task-runner dask")
