"""The cartridge: per-layer K/V rows in cache space, a frozen sink and trainable leaves.

Shape contract: per layer, keys `[kv_heads, p, head_dim]` and values of the same
`[kv_heads, p, head_dim_v]`, rotated at positions 0..p-1 and never rotated again.
The first `frozen` rows are constants (the attention sink); the rest are leaf
tensors with `requires_grad`. Layers may differ in geometry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cartridges.core.chat import system_ids
from cartridges.core.compress import keep_rows, rotary_of, snapkv_questions_keep, snapkv_rows
from cartridges.core.errors import CorpusError, GeometryError, ModelError
from cartridges.core.models import LoadedModel
from cartridges.core.prefix import capture_rows


class Cartridge:
    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        frozen: int = 1,
        meta: dict | None = None,
    ) -> None:
        if len(keys) != len(values) or not keys:
            raise GeometryError(f"cartridge needs one key and one value tensor per layer, got {len(keys)}/{len(values)}")
        p = keys[0].shape[1]
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k.dim() != 3 or v.dim() != 3 or k.shape[1] != p or v.shape[1] != p or k.shape[0] != v.shape[0]:
                raise GeometryError(
                    f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} are not [kv_heads, {p}, head_dim]"
                )
        if not 0 <= frozen <= p:
            raise GeometryError(f"frozen={frozen} must lie in 0..p={p}")
        self.frozen = frozen
        self.meta = dict(meta or {})
        self.frozen_keys = [k[:, :frozen].detach().clone() for k in keys]
        self.frozen_values = [v[:, :frozen].detach().clone() for v in values]
        self.train_keys = [k[:, frozen:].detach().clone().requires_grad_(True) for k in keys]
        self.train_values = [v[:, frozen:].detach().clone().requires_grad_(True) for v in values]

    @property
    def p(self) -> int:
        return self.frozen_keys[0].shape[1] + self.train_keys[0].shape[1]

    @property
    def n_layers(self) -> int:
        return len(self.train_keys)

    @property
    def geometry(self) -> list[list[int]]:
        """Per layer `[kv_heads_k, head_dim_k, kv_heads_v, head_dim_v]` (as in the fingerprint)."""
        return [[k.shape[0], k.shape[2], v.shape[0], v.shape[2]] for k, v in zip(self.train_keys, self.train_values, strict=True)]

    @property
    def dtype(self) -> torch.dtype:
        return self.train_keys[0].dtype

    def parameters(self) -> list[torch.Tensor]:
        """The trainable leaves, keys then values per layer."""
        out = []
        for k, v in zip(self.train_keys, self.train_values, strict=True):
            out += [k, v]
        return out

    def rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Full per-layer rows (sink + trainable); differentiable into the leaves."""
        return [
            (torch.cat([fk, tk], dim=1), torch.cat([fv, tv], dim=1))
            for fk, tk, fv, tv in zip(self.frozen_keys, self.train_keys, self.frozen_values, self.train_values, strict=True)
        ]

    def detached_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            return [(k.detach(), v.detach()) for k, v in self.rows()]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Cartridge:
        """A copy on another device/dtype (fresh leaves)."""
        rows = self.detached_rows()
        return Cartridge(
            [k.to(device=device, dtype=dtype) for k, _ in rows],
            [v.to(device=device, dtype=dtype) for _, v in rows],
            self.frozen,
            self.meta,
        )

    def with_trainable(self, leaves: Sequence[torch.Tensor]) -> Cartridge:
        """A copy whose trainable rows are `leaves` (in `parameters()` order), its frozen rows kept."""
        out = self.to()
        with torch.no_grad():
            for p, x in zip(out.parameters(), leaves, strict=True):
                p.copy_(x)
        return out

    def split(self, at: int, frozen: int | None = None) -> tuple[Cartridge, Cartridge]:
        """Rows `[0, at)` and `[at, p)` as two parts; each keeps the rotations it has."""
        if not 0 < at < self.p:
            raise GeometryError(f"cannot split a p={self.p} cartridge at {at}")
        rows = self.detached_rows()
        f = self.frozen if frozen is None else frozen
        first = Cartridge([k[:, :at] for k, _ in rows], [v[:, :at] for _, v in rows], min(f, at), self.meta)
        second = Cartridge([k[:, at:] for k, _ in rows], [v[:, at:] for _, v in rows], min(f, self.p - at), self.meta)
        return first, second

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[torch.Tensor, torch.Tensor]], frozen: int = 1, meta: dict | None = None) -> Cartridge:
        return cls([k for k, _ in rows], [v for _, v in rows], frozen, meta)


def compose_rows(parts: Sequence[Cartridge]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate parts in the order given; each keeps the rotations it was trained at."""
    if not parts:
        return []
    if len(parts) == 1:
        return parts[0].rows()
    first = parts[0].geometry
    for i, part in enumerate(parts[1:], start=1):
        if part.geometry != first:
            raise GeometryError(
                f"composition part {i} has geometry {_brief(part.geometry)}, part 0 has {_brief(first)}"
            )
    per_part = [part.rows() for part in parts]
    return [
        (torch.cat([r[i][0] for r in per_part], dim=1), torch.cat([r[i][1] for r in per_part], dim=1))
        for i in range(len(first))
    ]


def _brief(geometry: list[list[int]]) -> str:
    """Compact geometry text: layers x heads x dim, expanded only when layers differ."""
    distinct = {tuple(g) for g in geometry}
    if len(distinct) == 1:
        hk, dk, hv, dv = geometry[0]
        dims = f"{hk}x{dk}" if (hk, dk) == (hv, dv) else f"k {hk}x{dk} / v {hv}x{dv}"
        return f"{len(geometry)} layers x {dims}"
    return f"{len(geometry)} layers {geometry}"


def corpus_prefix_ids(lm: LoadedModel, text: str, p: int) -> list[int]:
    """The first p tokens of the corpus wrapped as a system message (template tokens count)."""
    ids = system_ids(lm.tokenizer, text)
    if len(ids) < p:
        raise CorpusError(
            f"corpus too short for p={p}: the system-wrapped corpus has {len(ids)} tokens, needs {p}; "
            f"train a smaller cartridge (p at most {len(ids)})"
        )
    return ids[:p]


def init_from_corpus(lm: LoadedModel, text: str, p: int, frozen: int = 1) -> Cartridge:
    """The paper's winning init: the model's own K/V for the corpus's first p tokens."""
    ids = torch.tensor(corpus_prefix_ids(lm, text, p), device=lm.device)
    return Cartridge.from_rows(_float32(capture_rows(lm.model, ids)), frozen, {"init": "corpus"})


def init_from_snapkv(lm: LoadedModel, text: str, p: int, frozen: int = 1,
                     questions: Sequence[Sequence[int]] | None = None) -> Cartridge:
    """Rows drawn from the whole corpus: SnapKV's choice over its full KV, keys re-rotated to 0..p-1.

    The first-p init holds the opening of a document exactly and nothing of the rest; training
    then trades the one for the other. These rows start with some of every part instead. The
    `frozen` rows are the corpus's first tokens, exactly, whatever SnapKV scores them: with a
    larger `frozen`, an opening training cannot erode and chosen rows from the rest. With
    `questions` (token ids), those questions are SnapKV's observation window instead of the
    corpus's own tail."""
    reason = snapkv_init_reason(lm)
    if reason:
        raise ModelError(f"{reason}; use init 'corpus'")
    corpus_prefix_ids(lm, text, p)  # the same length check as the corpus init
    ids = torch.tensor(system_ids(lm.tokenizer, text)[: lm.context_length], device=lm.device)
    full = capture_rows(lm.model, ids)
    if questions is None:
        return Cartridge.from_rows(_float32(snapkv_rows(lm.model, ids, full, p, rotary_of(lm.model), first=frozen)),
                                   frozen, {"init": "snapkv"})
    window = [torch.tensor(list(q), device=lm.device) for q in questions]
    keep = snapkv_questions_keep(lm.model, full, p, window, first=frozen)
    return Cartridge.from_rows(_float32(keep_rows(full, keep, rotary_of(lm.model))), frozen,
                               {"init": "snapkv_questions"})


def snapkv_init_reason(lm: LoadedModel) -> str | None:
    """Why SnapKV's rows cannot be re-rotated to 0..p-1 for this model; None when they can."""
    if rotary_of(lm.model) is None or len(set(getattr(lm.model.config, "layer_types", None) or ())) > 1:
        return (f"init 'snapkv' needs one plain rotary embedding for every layer, which {lm.name} lacks "
                "(its layers differ in attention type or rotary)")
    return None


def resolve_init(lm: LoadedModel, init: str) -> str:
    """'auto' is SnapKV's rows where the model allows them (they closed more of the gold-NLL gap
    on every document and seed measured, docs/QUALITY.md), else the corpus's first rows."""
    if init != "auto":
        return init
    return "corpus" if snapkv_init_reason(lm) else "snapkv"


def default_frozen(init: str, p: int) -> int:
    """Rows held constant when a run names none. Under snapkv, the first half: the corpus's
    opening exactly, beside SnapKV's rows from the rest (on six documents and seeds this
    closed as much of the gold-NLL gap as one sink row and answered 4 points more,
    docs/QUALITY.md). The corpus and random inits keep one sink row, as measured."""
    return p // 2 if init in ("snapkv", "snapkv_questions") else 1


def init_cartridge(lm: LoadedModel, text: str, init: str, p: int, frozen: int | None = None,
                   seed: int = 0, questions: Sequence[Sequence[int]] = ()) -> Cartridge:
    """The cartridge a run starts from; its `meta["init"]` names the init actually used and its
    `frozen` the rows held constant (`default_frozen` when `frozen` is None). `questions` (token
    ids) are the observation window of init 'snapkv_questions'."""
    init = resolve_init(lm, init)
    if frozen is None:
        frozen = default_frozen(init, p)
    if init == "corpus":
        return init_from_corpus(lm, text, p, frozen)
    if init == "snapkv":
        return init_from_snapkv(lm, text, p, frozen)
    if init == "snapkv_questions":
        if not questions:
            raise ValueError("init 'snapkv_questions' needs self-study questions; none were given")
        return init_from_snapkv(lm, text, p, frozen, questions)
    if init == "random":
        return init_random(lm, text, p, frozen, seed)
    raise ValueError(f"init {init!r}: unknown (auto, corpus, snapkv, snapkv_questions or random)")


def init_random(lm: LoadedModel, text: str, p: int, frozen: int = 1, seed: int = 0) -> Cartridge:
    """Ablation init: the sink rows are real, the rest random at each layer's own scale."""
    ids = torch.tensor(corpus_prefix_ids(lm, text, p), device=lm.device)
    real = capture_rows(lm.model, ids)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    for k, v in real:
        rk = torch.randn(k.shape, generator=gen, dtype=torch.float32).to(k) * k.float().std().item()
        rv = torch.randn(v.shape, generator=gen, dtype=torch.float32).to(v) * v.float().std().item()
        rk[:, :frozen], rv[:, :frozen] = k[:, :frozen], v[:, :frozen]
        rows.append((rk, rv))
    return Cartridge.from_rows(_float32(rows), frozen, {"init": "random"})


def _float32(rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Trainable rows (and so Adam's moments) are float32 whatever the model computes in."""
    return [(k.float(), v.float()) for k, v in rows]
