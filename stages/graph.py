"""The cartridge job's stage graph, declared once.

Each row names a stage, the module whose `run(job, config, *inputs)` runs it, the stages
whose artifacts it reads (passed to `run` in this order) and the section of
`PipelineConfig` it takes (None: the stage has no section). Modules load on first use,
so the CLI can offer the stage names without loading the model libraries. The rows are in an order that runs every input first. The
flow, `run_pipeline`, `cartridges stage NAME`, `--force` and docs/DESIGN.md's drawing
all read this table: adding a stage is its module plus one row here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from schemas import PipelineConfig

if TYPE_CHECKING:
    from storage import StageResult


@dataclass(frozen=True)
class Stage:
    name: str
    module: str
    inputs: tuple[str, ...]
    config: str | None

    @property
    def run(self) -> Callable[..., StageResult]:
        return importlib.import_module(self.module).run

    def section(self, config: PipelineConfig):
        return getattr(config, self.config) if self.config else None


CARTRIDGE: tuple[Stage, ...] = (
    Stage("ingest", "stages.ingest", inputs=(), config="ingest"),
    Stage("chunks", "stages.chunks", inputs=("ingest",), config="chunks"),
    Stage("synthesize", "stages.synthesize", inputs=("ingest", "chunks"), config="synth"),
    Stage("facts", "stages.facts", inputs=("ingest", "synthesize"), config=None),
    Stage("teacher", "stages.teacher", inputs=("synthesize",), config="teacher"),
    Stage("train", "stages.train", inputs=("ingest", "synthesize", "teacher"), config="train"),
)
NAMES = tuple(s.name for s in CARTRIDGE)


def stage(name: str) -> Stage:
    for s in CARTRIDGE:
        if s.name == name:
            return s
    raise KeyError(f"no stage {name!r}; stages: {', '.join(NAMES)}")


def mermaid() -> str:
    """The graph as a Mermaid flowchart (docs/DESIGN.md holds this text; a test keeps it current)."""
    lines = ["flowchart LR", "    corpus[(corpus files)] --> ingest"]
    for s in CARTRIDGE:
        lines += [f"    {i} --> {s.name}" for i in s.inputs]
    lines.append("    train --> cartridge[(cartridge.safetensors)]")
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid())
