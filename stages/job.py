"""What every stage of one run shares, so that each stage is called the same way.

A stage is `run(job, config, *inputs) -> StageResult`: the job carries the store, the
model (or only a tokenizer, for the stages that need no more), the corpus paths, the
catalog run and the stages to recompute; `config` is the stage's config section and
`inputs` are the artifacts of the stages it reads, in the order the graph lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cartridges.core.models import LoadedModel
from stages.fanout import Fanout
from storage import Store


@dataclass(frozen=True)
class Job:
    store: Store
    lm: LoadedModel | None = None
    corpus: tuple[str | Path, ...] = ()
    run_id: str | None = None
    force: frozenset[str] = field(default_factory=frozenset)
    fanout: Fanout | None = None
    tokenizer: Any = None  # by default the model's; alone, for the stages that need no model
    model_id: str | None = None  # the model a fingerprint names; by default the model's own id

    def __post_init__(self) -> None:
        if self.lm is not None:
            if self.tokenizer is None:
                object.__setattr__(self, "tokenizer", self.lm.tokenizer)
            if self.model_id is None:
                object.__setattr__(self, "model_id", self.lm.compute_id)

    @property
    def model(self) -> LoadedModel:
        if self.lm is None:
            raise TypeError("this stage runs the model; the job holds only a tokenizer")
        return self.lm

    def forced(self, stage: str) -> bool:
        return stage in self.force
