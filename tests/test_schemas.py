"""Config defaults and validation, and table schema validation."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from schemas import (
    SEED_TYPES,
    TABLES,
    ChunkConfig,
    ConfigError,
    IngestConfig,
    PipelineConfig,
    SchemaError,
    SynthConfig,
    TeacherConfig,
    TrainConfig,
    schema_version,
    validate_table,
)


def test_defaults_are_exact() -> None:
    train, chunks, synth, teacher = TrainConfig(), ChunkConfig(), SynthConfig(), TeacherConfig()
    assert (train.p, train.frozen, train.lr, train.accum, train.epochs) == (1024, None, 2e-2, 4, 2)
    assert (train.init, train.pack, train.checkpoint, train.save_every, train.seed) == (
        "auto", True, False, 0, 7)
    assert (chunks.chunk_min, chunks.chunk_max, chunks.conversations, chunks.heldout) == (
        256, 512, 1000, 16)
    assert chunks.seed == 7
    assert chunks.seed_types == ("structuring", "summarization", "question", "use_case",
                                 "creative", "mechanism", "verbatim")
    assert (synth.max_q, synth.max_a, synth.temperature_a, synth.gen_batch) == (64, 160, 0.6, 64)
    assert (synth.seed, synth.filter, synth.focus) == (7, True, True)
    assert (teacher.top_k, teacher.top_mass, teacher.batch) == (20, 0.99, 8)
    assert IngestConfig().max_bytes == 16 * 1024 * 1024
    assert IngestConfig().extensions == (".md", ".txt")
    for cls in (IngestConfig, ChunkConfig, SynthConfig, TeacherConfig, TrainConfig,
                PipelineConfig):
        assert cls.VERSION == 1


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (TrainConfig, "p", 0),
        (TrainConfig, "frozen", TrainConfig().p),  # frozen must stay below p
        (TrainConfig, "frozen", -1),
        (TrainConfig, "frozen", "4"),  # None or an int, nothing else
        (TrainConfig, "frozen", 4.0),
        (TrainConfig, "lr", 0.0),
        (TrainConfig, "accum", 0),
        (TrainConfig, "epochs", 0),
        (TrainConfig, "init", "zeros"),
        (TrainConfig, "p", "256"),
        (TrainConfig, "pack", 1),
        (ChunkConfig, "chunk_min", 15),
        (ChunkConfig, "chunk_max", 255),
        (ChunkConfig, "conversations", 0),
        (ChunkConfig, "heldout", -1),
        (ChunkConfig, "seed_types", ()),
        (ChunkConfig, "seed_types", ("question", "gossip")),
        (SynthConfig, "temperature_a", 0.0),
        (SynthConfig, "temperature_a", 2.5),
        (SynthConfig, "max_q", 0),
        (SynthConfig, "max_a", -3),
        (SynthConfig, "gen_batch", 0),
        (TeacherConfig, "top_k", 0),
        (TeacherConfig, "top_k", 1001),
        (TeacherConfig, "top_mass", 0.0),
        (TeacherConfig, "top_mass", 1.5),
        (IngestConfig, "max_bytes", 0),
    ],
)
def test_invalid_values_name_the_field(cls: type, field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**{field: value})
    assert f".{field}" in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_boundaries_accepted() -> None:
    assert TrainConfig(p=1, frozen=0).p == 1
    assert ChunkConfig(chunk_min=16, chunk_max=16).chunk_max == 16
    assert SynthConfig(temperature_a=2).temperature_a == 2.0
    assert TeacherConfig(top_k=1000, top_mass=1).top_mass == 1.0
    assert ChunkConfig(seed_types=["verbatim"]).seed_types == ("verbatim",)


def test_replace_validates_and_keeps_original() -> None:
    base = TrainConfig()
    assert base.replace(lr=1e-2).lr == 1e-2
    assert base.lr == 2e-2
    with pytest.raises(ConfigError, match="frozen"):
        base.replace(p=4, frozen=4)
    with pytest.raises(ConfigError, match="nope"):
        base.replace(nope=1)
    with pytest.raises(ConfigError, match=r"average.*\[0, 1\]"):
        base.replace(average=1.5)


def test_pipeline_round_trip_is_json_safe_and_sorted() -> None:
    cfg = PipelineConfig(train=TrainConfig(p=32), chunks=ChunkConfig(seed_types=("verbatim",)))
    d = cfg.to_dict()
    assert list(d) == sorted(d)
    assert all(list(sub) == sorted(sub) for sub in d.values())
    again = PipelineConfig.from_dict(json.loads(json.dumps(d)))
    assert again == cfg
    assert d["train"]["p"] == 32
    assert d["chunks"]["seed_types"] == ["verbatim"]
    assert PipelineConfig.from_dict({}) == PipelineConfig()


def test_from_dict_rejects_unknown_and_nested_bad_values() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        PipelineConfig.from_dict({"bogus": {}})
    with pytest.raises(ConfigError, match=r"train.*top_k|top_k"):
        PipelineConfig.from_dict({"train": {"top_k": 3}})
    with pytest.raises(ConfigError, match=r"PipelineConfig\.teacher.*top_k"):
        PipelineConfig.from_dict({"teacher": {"top_k": 0}})


def test_every_table_has_a_version_and_expected_columns() -> None:
    assert set(TABLES) == {"documents", "chunks", "conversations", "targets", "train_steps",
                           "evals", "benchmarks", "index_chunks", "sentences", "runs"}
    for name, schema in TABLES.items():
        assert schema_version(schema) == (2 if name == "conversations" else 1)
    conv = TABLES["conversations"]
    assert conv.field("answer_topk_ids").nullable  # kept teacher targets (version 2)
    assert conv.field("teacher_ids").type == pa.list_(pa.int32())
    assert conv.field("temperature_a").type == pa.float32()
    assert TABLES["targets"].names == ["conv_id", "position", "topk_ids", "topk_logprobs"]
    assert TABLES["train_steps"].field("heldout_loss").nullable
    assert not TABLES["train_steps"].field("loss").nullable
    assert TABLES["runs"].field("started_at").type == pa.timestamp("us", tz="UTC")
    assert TABLES["documents"].field("text").type == pa.large_string()
    assert len(SEED_TYPES) == 7


def _targets(**override: object) -> pa.Table:
    cols: dict[str, object] = {
        "conv_id": pa.array([1, 2], pa.int64()),
        "position": pa.array([5, 6], pa.int64()),
        "topk_ids": pa.array([[3, 4], [5]], pa.list_(pa.int64())),
        "topk_logprobs": pa.array([[-0.1, -2.0], [-0.01]], pa.list_(pa.float64())),
    }
    cols.update(override)
    return pa.table(cols)


def test_validate_table_casts_within_kind_and_orders_columns() -> None:
    t = _targets().select(["topk_ids", "conv_id", "topk_logprobs", "position"])
    out = validate_table("targets", t)
    assert out.schema.equals(TABLES["targets"], check_metadata=True)
    assert out.column("position").to_pylist() == [5, 6]
    assert out.column("topk_ids").to_pylist() == [[3, 4], [5]]


def test_validate_table_rejects_wrong_type_naming_column() -> None:
    with pytest.raises(SchemaError, match=r"'targets'.*'position'.*string"):
        validate_table("targets", _targets(position=pa.array(["5", "6"])))
    with pytest.raises(SchemaError, match=r"'topk_ids'"):
        validate_table("targets", _targets(topk_ids=pa.array([1.5, 2.5])))


def test_validate_table_rejects_overflow_nulls_missing_extra_and_bad_split() -> None:
    with pytest.raises(SchemaError, match="'position'"):
        validate_table("targets", _targets(position=pa.array([1, 2**40], pa.int64())))
    with pytest.raises(SchemaError, match=r"'conv_id'.*null"):
        validate_table("targets", _targets(conv_id=pa.array([1, None], pa.int64())))
    with pytest.raises(SchemaError, match="missing column.*topk_logprobs"):
        validate_table("targets", _targets().drop_columns(["topk_logprobs"]))
    with pytest.raises(SchemaError, match="unexpected column.*extra"):
        validate_table("targets", _targets(extra=pa.array([0, 0])))
    with pytest.raises(SchemaError, match="unknown table"):
        validate_table("nope", _targets())
    chunks = pa.table({
        "chunk_id": [1], "doc_id": [0], "start": [0], "end": [16], "tokens": [16],
        "seed_type": ["question"], "split": ["test"], "rng_seed": [3], "token_ids": [[1, 2]],
    })
    with pytest.raises(SchemaError, match=r"'split'.*'test'"):
        validate_table("chunks", chunks)
    ok = validate_table("chunks", chunks.set_column(6, "split", pa.array(["heldout"])))
    assert ok.column("split").to_pylist() == ["heldout"]


def test_nullable_column_accepts_nulls() -> None:
    steps = pa.table({
        "run_id": ["r"], "step": [1], "docs": [["a"]], "visibility": ["iso"], "loss": [0.5],
        "lr": [1e-3], "tokens": [10], "seconds": [0.1], "heldout_loss": pa.array([None], pa.null()),
    })
    out = validate_table("train_steps", steps)
    assert out.column("heldout_loss").type == pa.float64()
    assert out.column("heldout_loss").to_pylist() == [None]


def test_added_fields_stay_out_of_the_fingerprint_at_their_defaults() -> None:
    """Fields added after artifacts existed (spec_b, schedule, warmup, average, draft_ref): at their
    defaults the dict, and so every stage fingerprint, is what it was before they existed."""
    from storage.fingerprint import fingerprint

    train, synth = TrainConfig(), SynthConfig()
    for cfg, fields in ((train, ("schedule", "warmup", "average", "draft_ref")), (synth, ("spec_b",))):
        d = cfg.to_dict()
        assert not set(fields) & set(d)
        assert type(cfg).from_dict(d) == cfg
    cosine = train.replace(schedule="cosine")
    assert cosine.to_dict()["schedule"] == "cosine" and TrainConfig.from_dict(cosine.to_dict()) == cosine
    assert fingerprint("train", 1, cosine.to_dict(), []) != fingerprint("train", 1, train.to_dict(), [])
    assert fingerprint("train", 1, train.replace(warmup=0.0).to_dict(), []) == fingerprint("train", 1, train.to_dict(), [])
    # focus is on by default now; off, as every synthesis before it existed was, it stays out
    assert synth.to_dict()["focus"] is True and "focus" not in synth.replace(focus=False).to_dict()
