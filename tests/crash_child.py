"""The child side of the crash harness: imported once by the forkserver, run per child."""

from __future__ import annotations

import os
import sys

import torch

import cli.main  # noqa: F401  (imported before forking, so children start warm)
import jobs.fleet  # noqa: F401


def main(argv: list[str], env: dict[str, str], log: str) -> None:
    for key, value in env.items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from cli.main import main as cli

    code = cli(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
