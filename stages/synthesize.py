"""Self-study synthesis: bot A asks about a chunk, bot B answers with the chunk in context
(or, with `synth.teacher_context = "document"`, with the chunk's whole document).

Both bots are the frozen model. Bot A (temperature, chunk inline, seed-specific
instruction and assistant prefix) writes one message; degenerate messages are scored
and dropped before bot B runs. Bot B (greedy, chunk as the system turn) answers; its
prompt plus its tokens form the teacher sequence byte for byte, and the distribution
it chose each answer token from is that token's teacher target, kept (top-k) so the
teacher pass need not run the answers again. The student sequence is the same ids
with the chunk's system turn cut away (the cartridge takes its place).

With `synth.turns` above 1, a conversation goes on: bot A asks again about the chunk and
bot B answers behind the whole conversation; each turn is its own row.

Conversations about one chunk (several seed types) share their prompt heads: each bot
prefills the chunk once per group and continues every conversation behind those rows.
Conversations are written in shards of `gen_batch`; a rerun after a crash keeps the
finished shards and generates only the rest, and a run takes over the shards an earlier
run in the store wrote for the same planned chunks (unless the stage is forced).
"""

from __future__ import annotations

import pyarrow as pa

from cartridges.core.batch import Stream
from cartridges.core.chat import chat_ids, end_of_turn_ids, strip_think, system_ids
from cartridges.core.errors import CartridgeError
from cartridges.core.generate import LOOP_SPAN, generate, loop_start
from cartridges.core.models import LoadedModel
from cartridges.core.sharing import SHARE_MIN
from cartridges.selfstudy.facts import focus_sentence
from cartridges.selfstudy.seeds import (
    SEEDS,
    bot_a_prompt,
    clean_question,
    score_answer,
    score_message,
    stops_at_question,
)
from cartridges.selfstudy.spans import keyed_seed
from schemas import TABLES, SynthConfig, validate_table
from stages.fanout import report_resumed_shards
from stages.job import Job
from stages.progress import Bar
from stages.progress import progress as progress_bar
from stages.teacher import usable
from storage import StageContext, StageResult, StoreError, canonical_json, sha256_bytes
from storage.faults import fault_point
from storage.shards import done_shards, read_shard

NAME = "synthesize"
VERSION = 3


def question_stop_ids(tokenizer) -> tuple[int, ...]:
    """Ids of tokens that contain a '?': bot A stops at the end of its question."""
    cached = getattr(tokenizer, "_question_stop_ids", None)
    if cached is None:
        vocab = tokenizer.get_vocab()
        cached = tuple(sorted(i for t, i in vocab.items() if "?" in tokenizer.convert_tokens_to_string([t])))
        tokenizer._question_stop_ids = cached
    return cached


def chunk_context(chunk: dict, doc_names: dict[int, str], multi: bool, tokenizer) -> str:
    """The chunk as both bots see it; multi-document corpora name the document."""
    text = tokenizer.decode(chunk["token_ids"])
    return named(text, doc_names[chunk["doc_id"]]) if multi else text


def named(text: str, name: str) -> str:
    return f"Document: {name}\n\n{text}"


def document_contexts(docs: list[dict], config: SynthConfig, limit: int) -> dict[int, str]:
    """Each document as bot B sees it under teacher_context "document"; one that leaves no room
    in the model's context (`limit` tokens) for a conversation is an error naming it."""
    room = config.max_q + config.max_a + 128  # the chat template's turns around them
    too_long = [f"{d['name']} ({d['tokens']} tokens)" for d in docs if d["tokens"] + room > limit]
    if too_long:
        raise CartridgeError(
            f"synth.teacher_context=document: {', '.join(too_long)} leave no room in the model's {limit}-token "
            f"context for a conversation ({room} tokens); use teacher_context=chunk")
    return {d["doc_id"]: named(d["text"], d["name"]) if len(docs) > 1 else d["text"] for d in docs}


def focus_of(chunk: dict, config: SynthConfig, tokenizer, turn: int = 0) -> str | None:
    """The sentence this conversation asks about: a span's conversations have consecutive
    chunk ids, so they take consecutive sentences from an offset keyed by the span. A later
    turn's offset is keyed by the turn too, so a follow-up asks about another sentence."""
    key = (config.seed, "focus", chunk["doc_id"], chunk["start"], chunk["end"]) + ((turn,) if turn else ())
    return focus_sentence(tokenizer.decode(chunk["token_ids"]), keyed_seed(*key) + int(chunk["chunk_id"]))


def synthesize_group(
    lm: LoadedModel, chunks: list[dict], contexts: list[str], config: SynthConfig,
    answer_contexts: list[str] | None = None,
) -> list[dict]:
    """One group of conversations (rows of the `conversations` table), in chunk order. Bot A sees
    `contexts`; bot B and so the teacher see `answer_contexts` (default: the same).

    With `config.turns` above 1 a conversation whose turn passed the filter goes on: bot A asks
    again about the chunk (another seed draw and focus sentence; it is not shown the exchange,
    whose questions the 135M model copies) and bot B answers with the whole conversation in
    context. A question that repeats one of its conversation's is dropped ("repeat"). Each turn
    is a row (conv_id = chunk_id * turns + turn) whose teacher and student sequences hold the
    earlier turns, so every assistant turn is supervised, each in its context.
    """
    answer_contexts = contexts if answer_contexts is None else answer_contexts
    turns = [[] for _ in chunks]  # rows of each conversation, turn by turn
    live = list(range(len(chunks)))
    for turn in range(config.turns):
        if not live:
            break
        done = _turn(lm, [chunks[i] for i in live], [contexts[i] for i in live],
                     [answer_contexts[i] for i in live], [turns[i] for i in live], config, turn)
        for i, row in zip(live, done, strict=True):
            turns[i].append(row)
        live = [i for i in live if turns[i][-1]["answer"] and usable(turns[i][-1], config.filter)]
    return [row for rows in turns for row in rows]


def _said(question: str) -> str:
    return " ".join(question.lower().split())


def _turn(
    lm: LoadedModel, chunks: list[dict], contexts: list[str], answer_contexts: list[str],
    earlier: list[list[dict]], config: SynthConfig, turn: int,
) -> list[dict]:
    """Turn `turn` of each conversation (one row each), after the rows of its `earlier` turns."""
    tok = lm.tokenizer
    eot = tuple(end_of_turn_ids(tok))
    a_streams = []
    for chunk, ctx in zip(chunks, contexts, strict=True):
        stops = eot + (question_stop_ids(tok) if stops_at_question(chunk["seed_type"], config.stop_at_question) else ())
        focus = focus_of(chunk, config, tok, turn) if config.focus else None
        seed = int(chunk["rng_seed"]) if turn == 0 else keyed_seed(chunk["rng_seed"], "turn", turn)
        a_streams.append(Stream(
            prompt=bot_a_prompt(tok, ctx, chunk["seed_type"], focus), max_new=config.max_q,
            temperature=config.temperature_a, top_p=config.top_p_a, seed=seed, stop_ids=stops,
        ))
    a_out = generate(lm.model, a_streams, batch_size=config.gen_batch, share_min=SHARE_MIN)
    if turn == 0:
        fault_point("synthesize.questions")  # questions generated, answers not yet

    rows, b_streams, b_index = [], [], []
    for i, (chunk, ctx, before, gen) in enumerate(zip(chunks, answer_contexts, earlier, a_out, strict=True)):
        raw = tok.decode([t for t in gen.tokens if t not in eot], skip_special_tokens=True)
        question = clean_question(raw, chunk["seed_type"], config.stop_at_question)
        ok, reason = score_message(question, SEEDS[chunk["seed_type"]].instruction)
        if ok and _said(question) in {_said(r["question"]) for r in before}:
            ok, reason = False, "repeat"
        conv_id = int(chunk["chunk_id"]) * config.turns + turn
        rows.append(_row(chunk, config, conv_id, question, ok, reason, len(gen.tokens)))
        if ok or not config.filter:
            messages = [{"role": "system", "content": ctx}]
            for r in before:
                messages += [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
            messages.append({"role": "user", "content": question})
            b_streams.append(Stream(prompt=chat_ids(tok, messages, add_generation_prompt=True),
                                    max_new=config.max_a, stop_ids=eot, loop_span=LOOP_SPAN,
                                    keep_topk=config.keep_topk, draft=config.spec_b))
            b_index.append(i)
    b_out = generate(lm.model, b_streams, batch_size=config.gen_batch, share_min=SHARE_MIN)

    for i, stream, gen in zip(b_index, b_streams, b_out, strict=True):
        row, ctx = rows[i], answer_contexts[i]
        answer_tokens, topk = list(gen.tokens), list(gen.topk)
        cut = loop_start(answer_tokens, LOOP_SPAN)
        if cut is not None:  # keep the answer up to its loop; the repeats teach nothing but looping
            answer_tokens, topk = answer_tokens[:cut], topk[:cut]
        text = tok.decode([t for t in answer_tokens if t not in eot], skip_special_tokens=True)
        answer = strip_think(text)
        if answer != text.strip():  # marked reasoning removed: supervise the cleaned answer
            answer_tokens = tok(answer, add_special_tokens=False)["input_ids"] + [eot[0]]
            topk = []  # other tokens than bot B read: the teacher pass computes their targets
        teacher = list(stream.prompt) + answer_tokens
        head = system_ids(tok, ctx)
        if teacher[: len(head)] != head:
            raise ValueError("chat template does not render the system turn as a prefix")
        ok, reason = score_answer(answer, row["question"])
        if ok and cut is not None:
            reason = "loop_cut"
        row.update(
            answer=answer, teacher_ids=teacher, student_ids=teacher[len(head):],
            answer_start=len(stream.prompt), student_answer_start=len(stream.prompt) - len(head),
            b_ok=ok, b_reason=reason, a_tokens=len(answer_tokens),
            answer_topk_ids=[ids for ids, _ in topk] if topk else None,
            answer_topk_logprobs=[lp for _, lp in topk] if topk else None,
        )
    return rows


def _row(chunk: dict, config: SynthConfig, conv_id: int, question: str, ok: bool, reason: str, q_tokens: int) -> dict:
    return {
        "conv_id": conv_id, "chunk_id": int(chunk["chunk_id"]), "doc_id": int(chunk["doc_id"]),
        "seed_type": chunk["seed_type"], "split": chunk["split"], "question": question, "answer": "",
        "teacher_ids": [], "student_ids": [], "answer_start": 0, "student_answer_start": 0,
        "a_ok": ok, "b_ok": False, "a_reason": reason, "b_reason": "skipped" if not ok else "",
        "temperature_a": config.temperature_a, "max_q": config.max_q, "max_a": config.max_a,
        "rng_seed": int(chunk["rng_seed"]), "q_tokens": q_tokens, "a_tokens": 0,
        "answer_topk_ids": None, "answer_topk_logprobs": None,
    }


def synth_shard(job: dict) -> int:
    """One shard of conversations, computed and written by a worker (no catalog); returns its rows."""
    from stages.fanout import worker_model
    from storage.shards import write_shard

    lm = worker_model(job["model"])
    rows = synthesize_group(lm, job["chunks"], job["contexts"], SynthConfig.from_dict(job["config"]),
                            answer_contexts=job["answer_contexts"])
    table = validate_table("conversations", pa.Table.from_pylist(rows, schema=TABLES["conversations"]))
    write_shard(job["dir"], job["shard"], table)
    fault_point(f"synthesize.shard.{job['shard']}")
    return len(rows)


def _group_key(rows: list[dict]) -> str:
    return sha256_bytes(canonical_json(rows).encode())


def take_earlier_shards(ctx: StageContext, plan: list[dict], size: int) -> int:
    """Copy in the shards that an earlier synthesis in this store already wrote for the same
    documents, code, config and model from the same planned chunks; returns their conversations.
    Chunk plans are prefix-stable, so raising `--conversations` synthesizes only the new ones."""
    documents = ctx.inputs[0].fingerprint
    earlier_runs = [(other, chunks) for other, (docs, chunks) in ctx.store.siblings(ctx.artifact, VERSION)
                    if docs.fingerprint == documents]
    done = ctx.done_shards()
    wanted = {} if not earlier_runs else {  # the plan is hashed only when there is a run to take from
        _group_key(plan[start : start + size]): shard
        for shard, start in enumerate(range(0, len(plan), size)) if shard not in done}
    taken = 0
    for other, chunks in earlier_runs:
        if not wanted:
            break
        try:
            earlier = ctx.read(chunks).to_pylist()
            for index, path in done_shards(ctx.store.dir(other)).items():
                shard = wanted.pop(_group_key(earlier[index * size : (index + 1) * size]), None)
                if shard is not None:
                    ctx.write_shard(shard, read_shard(path, TABLES["conversations"]))
                    taken += len(plan[shard * size : (shard + 1) * size])
        except StoreError as e:  # a damaged earlier run: its shards are computed again
            print(f"warning: synthesize: not reusing an earlier run's shards: {e}", flush=True)
    return taken


def run(job: Job, config: SynthConfig, documents, chunks) -> StageResult:
    """Conversations for every planned chunk, sharded by `gen_batch`; the job's fanout sends shards
    to workers. The progress bar counts the planned conversations, those of shards an earlier run
    finished first, so it ends full on a resumed run too."""
    with progress_bar(chunks.rows, "self-study", "conv") as bar:
        return _run(job, config, documents, chunks, bar)


def _run(job: Job, config: SynthConfig, documents, chunks, bar: Bar) -> StageResult:
    store, lm, fanout = job.store, job.model, job.fanout

    def work(ctx: StageContext) -> None:
        docs = ctx.read(documents).to_pylist()
        names = {d["doc_id"]: d["name"] for d in docs}
        whole = document_contexts(docs, config, lm.context_length) if config.teacher_context == "document" else None
        plan = ctx.read(chunks).to_pylist()
        size = config.gen_batch
        taken = 0 if job.forced(NAME) else take_earlier_shards(ctx, plan, size)
        done = ctx.done_shards()
        jobs = []
        report_resumed_shards(bar, plan, size, done)
        if taken:
            print(f"synthesize: {taken} of {len(plan)} conversations taken from earlier runs in this store",
                  flush=True)
        for shard, start in enumerate(range(0, len(plan), size)):
            if shard in done:
                continue
            group = plan[start : start + size]
            contexts = [chunk_context(c, names, len(docs) > 1, lm.tokenizer) for c in group]
            answer_contexts = None if whole is None else [whole[c["doc_id"]] for c in group]
            if fanout is not None:
                jobs.append({"model": fanout.model, "config": config.to_dict(), "chunks": group,
                             "contexts": contexts, "answer_contexts": answer_contexts, "dir": str(ctx.dir),
                             "shard": shard})
                continue
            rows = synthesize_group(lm, group, contexts, config, answer_contexts)
            ctx.write_shard(shard, validate_table("conversations", pa.Table.from_pylist(rows, schema=TABLES["conversations"])))
            fault_point(f"synthesize.shard.{shard}")
            bar.update(len(group))
        if jobs:
            fanout.map(synth_shard, jobs, lambda job: bar.update(len(job["chunks"])))

    cfg = {**config.fingerprint_dict(), "model": job.model_id or ""}
    return store.run(NAME, VERSION, cfg, [documents, chunks], work, force=job.forced(NAME), run_id=job.run_id)
