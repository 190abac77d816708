"""Arrow schemas of every artifact table.

Each schema carries its version in the metadata (``b"schema_version"``) so a
reader can tell which layout a Parquet file was written with.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION_KEY = b"schema_version"
SPLITS = ("train", "heldout")


class SchemaError(ValueError):
    """A table does not match its declared schema; the message names table and column."""


def _schema(name: str, version: int, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields).with_metadata(
        {SCHEMA_VERSION_KEY: str(version).encode(), b"table": name.encode()}
    )


def _f(name: str, type_: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable)


_I32, _I64, _F32, _F64 = pa.int32(), pa.int64(), pa.float32(), pa.float64()
_STR, _BIG = pa.string(), pa.large_string()
_IDS = pa.list_(_I32)

DOCUMENTS = _schema("documents", 1, [
    _f("doc_id", _I32), _f("name", _STR), _f("path", _STR), _f("sha256", _STR),
    _f("tokens", _I32), _f("chars", _I64), _f("version", _I32), _f("text", _BIG),
])

CHUNKS = _schema("chunks", 1, [
    _f("chunk_id", _I64), _f("doc_id", _I32), _f("start", _I32), _f("end", _I32),
    _f("tokens", _I32), _f("seed_type", _STR), _f("split", _STR), _f("rng_seed", _I64),
    _f("token_ids", _IDS),
])

CONVERSATIONS = _schema("conversations", 2, [
    _f("conv_id", _I64), _f("chunk_id", _I64), _f("doc_id", _I32), _f("seed_type", _STR),
    _f("split", _STR), _f("question", _STR), _f("answer", _STR),
    _f("teacher_ids", _IDS), _f("student_ids", _IDS),
    _f("answer_start", _I32), _f("student_answer_start", _I32),
    _f("a_ok", pa.bool_()), _f("b_ok", pa.bool_()), _f("a_reason", _STR), _f("b_reason", _STR),
    _f("temperature_a", _F32), _f("max_q", _I32), _f("max_a", _I32), _f("rng_seed", _I64),
    _f("q_tokens", _I32), _f("a_tokens", _I32),
    # Bot B's own top-k log-probabilities at each answer token: the teacher's targets, read
    # by the teacher pass instead of recomputed (null where the answer was re-tokenized).
    _f("answer_topk_ids", pa.list_(_IDS), nullable=True),
    _f("answer_topk_logprobs", pa.list_(pa.list_(_F32)), nullable=True),
])

TARGETS = _schema("targets", 1, [
    _f("conv_id", _I64), _f("position", _I32),
    _f("topk_ids", _IDS), _f("topk_logprobs", pa.list_(_F32)),
])

TRAIN_STEPS = _schema("train_steps", 1, [
    _f("run_id", _STR), _f("step", _I64), _f("docs", pa.list_(_STR)), _f("visibility", _STR),
    _f("loss", _F64), _f("lr", _F64), _f("tokens", _I64), _f("seconds", _F64),
    _f("heldout_loss", _F64, nullable=True),
])

EVALS = _schema("evals", 1, [
    _f("run_id", _STR), _f("arm", _STR), _f("metric", _STR), _f("value", _F64),
    _f("n", _I32), _f("details", _STR),
])

BENCHMARKS = _schema("benchmarks", 1, [
    _f("benchmark", _STR), _f("metric", _STR), _f("value", _F64), _f("compares", _STR),
    _f("goal", _STR), _f("measured_at", _STR), _f("quick", pa.bool_()),
])

INDEX_CHUNKS = _schema("index_chunks", 1, [
    _f("chunk_id", _I64), _f("doc_id", _I32), _f("doc_name", _STR),
    _f("start", _I32), _f("end", _I32), _f("text", _BIG),
])

SENTENCES = _schema("sentences", 1, [
    _f("doc_id", _I32), _f("sentence", _I32), _f("text", _BIG), _f("words", _I32),
    _f("conversations", _I32),
])

RUNS = _schema("runs", 1, [
    _f("run_id", _STR), _f("flow", _STR), _f("started_at", pa.timestamp("us", tz="UTC")),
    _f("finished_at", pa.timestamp("us", tz="UTC"), nullable=True),
    _f("status", _STR), _f("summary", _STR),
])

TABLES: dict[str, pa.Schema] = {
    s.metadata[b"table"].decode(): s
    for s in (DOCUMENTS, CHUNKS, CONVERSATIONS, TARGETS, TRAIN_STEPS, EVALS, BENCHMARKS, INDEX_CHUNKS,
              SENTENCES, RUNS)
}

# Columns whose values are a closed set; checked so a typo never reaches Parquet.
_ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("chunks", "split"): SPLITS,
    ("conversations", "split"): SPLITS,
}


def schema_version(schema: pa.Schema) -> int | None:
    """The version a schema (e.g. read back from a Parquet file) was written with."""
    meta = schema.metadata or {}
    raw = meta.get(SCHEMA_VERSION_KEY)
    return int(raw) if raw is not None else None


def _kind(t: pa.DataType) -> str:
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list"
    return str(t)


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Only lossless-in-kind casts: never parse strings into numbers or the reverse."""
    ks, kd = _kind(src), _kind(dst)
    if ks == "null":
        return True
    if ks == "list" and kd == "list":
        return _castable(src.value_type, dst.value_type)
    return ks == kd or (ks == "int" and kd == "float")


def validate_table(name: str, table: pa.Table) -> pa.Table:
    """Return ``table`` cast to the schema of ``name``, or raise SchemaError naming the column.

    Widening/narrowing within a kind (int64 -> int32, string -> large_string) is
    allowed when no value overflows; column order follows the schema.
    """
    if name not in TABLES:
        raise SchemaError(f"unknown table {name!r}; known tables: {', '.join(TABLES)}")
    schema = TABLES[name]
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise SchemaError(f"table {name!r}: missing column(s) {', '.join(missing)}")
    extra = [c for c in table.column_names if schema.get_field_index(c) < 0]
    if extra:
        raise SchemaError(f"table {name!r}: unexpected column(s) {', '.join(extra)}")
    if len(set(table.column_names)) != len(table.column_names):
        raise SchemaError(f"table {name!r}: duplicate column names {table.column_names}")
    columns = []
    for field in schema:
        col = table.column(field.name)
        where = f"table {name!r}, column {field.name!r}"
        if col.type != field.type:
            if not _castable(col.type, field.type):
                raise SchemaError(f"{where}: has type {col.type}, expected {field.type}")
            try:
                col = col.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SchemaError(f"{where}: cannot cast {col.type} to {field.type}: {e}") from e
        if not field.nullable and col.null_count:
            raise SchemaError(f"{where}: {col.null_count} null value(s) in a non-nullable column")
        allowed = _ENUMS.get((name, field.name))
        if allowed is not None and len(col):
            bad = pc.invert(pc.is_in(col, value_set=pa.array(allowed, col.type)))
            if pc.any(bad).as_py():
                first = col.filter(bad)[0].as_py()
                raise SchemaError(f"{where}: value {first!r} not in {list(allowed)}")
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=schema)
