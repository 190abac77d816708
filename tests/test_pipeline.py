"""The whole pipeline on a tiny model: skips, reruns, crash recovery, SQL, and the Prefect flow."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges.core.chat import end_of_turn_ids
from jobs.pipeline import run_pipeline
from schemas.presets import preset
from storage import Store, query
from storage.faults import InjectedFault
from tests.tiny import tiny_llama

CORPUS = (
    "Prefix caches hold keys and values. A cartridge is trained offline by self-study. "
    "The teacher sees the chunk; the student sees only the cartridge rows. "
) * 12


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.md"
    path.write_text(CORPUS)
    return path


def smoke(**train):
    # A random tiny model writes gibberish, so degenerate-message filtering is off here.
    return preset("smoke", {"synth": {"filter": False}, "train": train})


def test_pipeline_trains_and_an_unchanged_rerun_skips_every_stage(tmp_path, corpus):
    lm, store = tiny_llama(), Store(tmp_path / "store")
    first = run_pipeline(store, lm, [corpus], smoke(), save=tmp_path / "out.safetensors")
    assert first["skipped"] == []
    assert first["conversations"] == 8 and first["planned_conversations"] == 10
    assert first["heldout_loss_before"] is not None and first["heldout_loss_after"] is not None
    assert (tmp_path / "out.safetensors").is_file()
    assert (first["coverage_min"], first["coverage_mean"]) == _coverage_counted(store, per_chunk=4)
    again = run_pipeline(store, lm, [corpus], smoke())
    assert sorted(again["skipped"]) == sorted(["ingest", "chunks", "synthesize", "facts", "teacher", "train"])
    assert again["heldout_loss_after"] == first["heldout_loss_after"]


def test_sentences_table_lists_each_sentence_with_its_grounded_conversations(tmp_path, corpus):
    from cartridges.selfstudy.facts import sentences

    lm, store = tiny_llama(), Store(tmp_path / "store")
    summary = run_pipeline(store, lm, [corpus], smoke())
    _, rows = query(store.root, "select doc_id, sentence, text, conversations from sentences order by sentence")
    assert [r[2] for r in rows] == sentences(CORPUS) and {r[0] for r in rows} == {0}
    assert [r[1] for r in rows] == list(range(len(rows)))
    _, uncovered = query(store.root, "select text from sentences where conversations = 0")
    assert summary["fact_coverage"] == pytest.approx(1 - len(uncovered) / len(rows))


def _coverage_counted(store: Store, per_chunk: int) -> tuple[int, float]:
    """Per token, the training spans with a conversation that has teacher targets, counted directly."""
    docs = store.table(store.latest("ingest")).to_pylist()
    chunks = {c["chunk_id"]: c for c in store.table(store.latest("chunks")).to_pylist()}
    trained = set(store.table(store.latest("teacher")).column("conv_id").to_pylist())
    convs = store.table(store.latest("synthesize")).to_pylist()
    spans = {c["chunk_id"] // per_chunk: chunks[c["chunk_id"]] for c in convs
             if c["split"] == "train" and c["conv_id"] in trained}
    depth = {d["doc_id"]: [0] * d["tokens"] for d in docs}
    for span in spans.values():
        for t in range(span["start"], span["end"]):
            depth[span["doc_id"]][t] += 1
    flat = [x for d in depth.values() for x in d]
    return min(flat), pytest.approx(sum(flat) / len(flat))


def test_changing_chunk_max_reruns_chunks_and_downstream_but_reuses_ingest(tmp_path, corpus):
    lm, store = tiny_llama(), Store(tmp_path / "store")
    run_pipeline(store, lm, [corpus], smoke())
    cfg = smoke()
    cfg = cfg.replace(chunks=cfg.chunks.replace(chunk_max=48))
    second = run_pipeline(store, lm, [corpus], cfg)
    assert second["skipped"] == ["ingest"]


def test_student_sequences_have_no_injected_system_prompt_and_supervise_end_of_turn(tmp_path, corpus):
    lm, store = tiny_llama(), Store(tmp_path / "store")
    run_pipeline(store, lm, [corpus], smoke())
    convs = store.table(store.latest("synthesize")).to_pylist()
    targets = store.table(store.latest("teacher")).to_pylist()
    eot = set(end_of_turn_ids(lm.tokenizer))
    stopped = 0
    for c in convs:
        if not c["b_ok"]:
            continue
        student = lm.tokenizer.decode(c["student_ids"])
        assert "helpful assistant" not in student and student.startswith("<|im_start|>user")
        assert c["teacher_ids"][c["answer_start"]:] == c["student_ids"][c["student_answer_start"]:]
        positions = {t["position"] for t in targets if t["conv_id"] == c["conv_id"]}
        assert positions == set(range(c["student_answer_start"], len(c["student_ids"])))
        if c["student_ids"][-1] in eot:
            stopped += 1
            assert len(c["student_ids"]) - 1 in positions  # the closing end-of-turn token is supervised
    assert convs and stopped >= 0


def test_crash_midway_through_synthesis_then_rerun_gives_exactly_the_plan(tmp_path, corpus, monkeypatch):
    lm, store = tiny_llama(), Store(tmp_path / "store")
    monkeypatch.setenv("CARTRIDGES_FAULT", "synthesize.shard.1:raise")
    with pytest.raises(InjectedFault):
        run_pipeline(store, lm, [corpus], smoke())
    failed = [a for a in store.catalog.artifacts("synthesize")]
    assert [a.status for a in failed] == ["failed"]
    monkeypatch.delenv("CARTRIDGES_FAULT")
    bars, updates = _record_bars(monkeypatch)
    run_pipeline(store, lm, [corpus], smoke())
    convs = store.table(store.latest("synthesize")).column("conv_id").to_pylist()
    plan = store.table(store.latest("chunks")).column("chunk_id").to_pylist()
    assert sorted(convs) == sorted(plan) and len(set(convs)) == len(convs) == 10
    # the resumed run's bar counts the shards found done (two of three) as resumed, then the rest
    assert (bars["self-study"].n, bars["self-study"].total) == (10, 10)
    assert bars["self-study"].initial == 8 and updates["self-study"] == [2]


def test_more_conversations_synthesize_only_the_new_ones_and_equal_a_fresh_run(tmp_path, corpus, monkeypatch):
    """Raising the conversations keeps the plan's earlier chunks, so the full shards an earlier run of
    the same config wrote are taken over (the held-out conversations start the plan); the result
    equals a synthesis from scratch. Another config, or a forced stage, takes nothing."""
    lm, store = tiny_llama(), Store(tmp_path / "store")
    run_pipeline(store, lm, [corpus], smoke())  # 2 held out + 8, shards of 4
    more = preset("smoke", {"chunks": {"conversations": 16}, "synth": {"filter": False}})
    bars, updates = _record_bars(monkeypatch)
    run_pipeline(store, lm, [corpus], more)
    # shards 0 and 1 taken over, then 2, 3 and 4 (the smaller run's last shard was short)
    assert bars["self-study"].initial == 8 and updates["self-study"] == [4, 4, 2]
    fresh = Store(tmp_path / "fresh")
    run_pipeline(fresh, lm, [corpus], more)
    taken, made = (s.table(s.latest("synthesize")).sort_by("conv_id").to_pylist() for s in (store, fresh))
    assert len(taken) == 18 and taken == made
    bars, updates = _record_bars(monkeypatch)
    run_pipeline(store, lm, [corpus], smoke(), force=("synthesize",))
    assert bars["self-study"].initial == 0 and updates["self-study"] == [4, 4, 2]
    hotter = preset("smoke", {"chunks": {"conversations": 16}, "synth": {"filter": False, "temperature_a": 0.9}})
    bars, updates = _record_bars(monkeypatch)
    run_pipeline(store, lm, [corpus], hotter)
    assert bars["self-study"].initial == 0 and updates["self-study"] == [4, 4, 4, 4, 2]


def _record_bars(monkeypatch) -> tuple[dict, dict]:
    """The stages' progress bars by name, and the sizes of the updates each was given."""
    import contextlib
    import io

    from stages import synthesize, teacher, train
    from stages.progress import progress

    bars, updates = {}, {}

    @contextlib.contextmanager
    def recording_bar(total, desc, unit):
        with progress(total, desc, unit, out=io.StringIO()) as bar:
            bars[desc] = bar
            calls = updates[desc] = []
            inner = bar.update
            bar.update = lambda n=1: (calls.append(n), inner(n))
            yield bar

    for stage in (synthesize, teacher, train):
        monkeypatch.setattr(stage, "progress_bar", recording_bar)
    return bars, updates


def test_resumed_teacher_counts_its_finished_shards_as_resumed(tmp_path, corpus, monkeypatch):
    from stages import teacher

    lm, store = tiny_llama(), Store(tmp_path / "store")
    monkeypatch.setattr(teacher, "SHARD", 2)
    monkeypatch.setenv("CARTRIDGES_FAULT", "teacher.shard.1:raise")
    with pytest.raises(InjectedFault):
        run_pipeline(store, lm, [corpus], smoke())
    monkeypatch.delenv("CARTRIDGES_FAULT")
    bars, updates = _record_bars(monkeypatch)
    run_pipeline(store, lm, [corpus], smoke())
    targets = set(store.table(store.latest("teacher")).column("conv_id").to_pylist())
    assert len(targets) == bars["teacher"].n == 10  # training and held-out conversations
    assert bars["teacher"].initial == 4 and updates["teacher"] == [2, 2, 2]  # shards 0, 1 done; then 2, 3, 4


@pytest.mark.parametrize("schedule", [{}, {"schedule": "cosine", "warmup": 0.25}, {"average": 0.5}])
def test_training_resumes_from_its_checkpoint_to_the_same_cartridge(tmp_path, corpus, monkeypatch, schedule):
    import torch

    from cartridges.core.files import load_cartridge
    from cartridges.core.train import lr_at

    lm = tiny_llama()
    clean = Store(tmp_path / "clean")
    ref = run_pipeline(clean, lm, [corpus], smoke(save_every=1, **schedule))
    crashed = Store(tmp_path / "crashed")
    monkeypatch.setenv("CARTRIDGES_FAULT", "train.step.2:raise")
    with pytest.raises(InjectedFault):
        run_pipeline(crashed, lm, [corpus], smoke(save_every=1, **schedule))
    monkeypatch.delenv("CARTRIDGES_FAULT")
    bars, _ = _record_bars(monkeypatch)
    resumed = run_pipeline(crashed, lm, [corpus], smoke(save_every=1, **schedule))
    # the bar starts at the checkpoint (steps 0-2 done; the fault came after step 2's checkpoint)
    assert bars["train"].initial == 3 and bars["train"].n == bars["train"].total
    cfg = smoke(**schedule).train
    rates = crashed.table(crashed.latest("train")).column("lr").to_pylist()
    assert rates == [lr_at(i, len(rates), cfg.lr, cfg.schedule, cfg.warmup) for i in range(len(rates))]
    a, b = load_cartridge(ref["cartridge"]), load_cartridge(resumed["cartridge"])
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)
    assert resumed["losses"] == ref["losses"]


def test_averaged_cartridge_is_the_mean_of_the_rows_after_each_tail_step(tmp_path, corpus, monkeypatch):
    """Reference: the rows after every optimizer step of the same run without averaging, caught
    by a hook on the optimizer, then averaged by hand over the last half of the steps."""
    from cartridges.core.files import load_cartridge
    from stages import train as train_stage

    lm = tiny_llama()
    after_step: list[list[torch.Tensor]] = []
    make = train_stage.make_optimizer

    def recording(cart, lr):
        opt = make(cart, lr)
        opt.register_step_post_hook(lambda *_: after_step.append([p.detach().clone() for p in cart.parameters()]))
        return opt

    monkeypatch.setattr(train_stage, "make_optimizer", recording)
    run_pipeline(Store(tmp_path / "plain"), lm, [corpus], smoke(), save=tmp_path / "plain.safetensors")
    monkeypatch.setattr(train_stage, "make_optimizer", make)
    run = run_pipeline(Store(tmp_path / "avg"), lm, [corpus], smoke(average=0.5), save=tmp_path / "avg.safetensors")
    steps = len(after_step)
    assert steps >= 4 and run["steps"] == steps
    tail = after_step[steps - steps // 2:]
    want = [torch.stack(leaves).mean(0) for leaves in zip(*tail, strict=True)]
    plain, avg = load_cartridge(tmp_path / "plain.safetensors"), load_cartridge(tmp_path / "avg.safetensors")
    for p, last in zip(plain.parameters(), after_step[-1], strict=True):
        assert torch.equal(p, last)  # the hook saw what the run saved
    for p, w, last in zip(avg.parameters(), want, after_step[-1], strict=True):
        torch.testing.assert_close(p, w)
        assert not torch.allclose(p, last)
    for a, b in zip(avg.rows(), plain.rows(), strict=True):  # the frozen rows are not averaged
        assert torch.equal(a[0][:, : avg.frozen], b[0][:, : plain.frozen])


def test_a_rerun_that_only_changes_save_every_resumes_the_same_training(tmp_path, corpus, monkeypatch):
    """How often training checkpoints does not change the cartridge, so it stays out of the
    fingerprint: a long training started without checkpoints can be rerun with them (and the
    reverse) and the rerun resumes the same artifact instead of starting another."""
    import torch

    from cartridges.core.files import load_cartridge

    lm = tiny_llama()
    ref = run_pipeline(Store(tmp_path / "clean"), lm, [corpus], smoke())
    store = Store(tmp_path / "store")
    monkeypatch.setenv("CARTRIDGES_FAULT", "train.step.2:raise")
    with pytest.raises(InjectedFault):
        run_pipeline(store, lm, [corpus], smoke(save_every=1))
    # Resuming from the checkpoint after step 2 never runs step 0 again; a new training would.
    monkeypatch.setenv("CARTRIDGES_FAULT", "train.step.0:raise")
    resumed = run_pipeline(store, lm, [corpus], smoke())
    monkeypatch.delenv("CARTRIDGES_FAULT")
    a, b = load_cartridge(ref["cartridge"]), load_cartridge(resumed["cartridge"])
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)
    assert resumed["losses"] == ref["losses"]
    assert "train" in run_pipeline(store, lm, [corpus], smoke(save_every=3))["skipped"]


def test_flow_through_prefect_then_sql_returns_the_conversations(tmp_path, corpus, tiny_model_dir, capsys):
    from cli.main import main

    store = tmp_path / "store"
    code = main(["train", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--preset", "smoke",
                 "--no-filter", "--store", str(store), "--save", str(tmp_path / "c.safetensors"), "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert code == 0
    for key in ("heldout_loss_before", "heldout_loss_after", "conversations", "s_per_conversation", "cartridge",
                "coverage_min", "coverage_mean", "fact_coverage"):
        assert key in summary
    assert f"coverage per token: min {summary['coverage_min']}, mean {summary['coverage_mean']:.2f}" in "\n".join(out)
    columns, rows = query(store, "select count(*) as n, count(distinct conv_id) as d from conversations")
    assert rows[0] == (10, 10)
    code = main(["sql", "--store", str(store), "select seed_type, count(*) from conversations group by 1", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and sum(r[1] for r in result["rows"]) == 10


def test_stage_command_reruns_one_stage_and_runs_lists_artifacts(tmp_path, corpus, tiny_model_dir, capsys):
    from cartridges.core.models import load_model
    from cli.main import main

    store = tmp_path / "store"
    lm = load_model(str(tiny_model_dir))
    run_pipeline(Store(store), lm, [corpus], smoke())
    capsys.readouterr()
    common = ["--model", str(tiny_model_dir), "--store", str(store), "--preset", "smoke", "--json"]
    assert main(["stage", "chunks", *common]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped"] is True
    assert main(["stage", "chunks", "--chunk-max", "48", *common]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["skipped"] is False and result["rows"] == 10
    assert main(["runs", "--store", str(store), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stages = [a["stage"] for a in listed["artifacts"]]
    assert stages.count("chunks") == 2 and all(a["status"] == "complete" for a in listed["artifacts"])
    assert [r["status"] for r in listed["runs"]] == ["complete"]
    capsys.readouterr()
    assert main(["stage", "chunks", *common, "--minutes", "30"]) == 2  # a budget sizes a whole run
    assert "stage chunks: budget.minutes sizes a whole run" in capsys.readouterr().err
    # the default preset's time budget is for whole runs: one stage takes the configured size
    assert main(["stage", "chunks", "--model", str(tiny_model_dir), "--store", str(store), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["skipped"] is False and result["rows"] > 10


@pytest.mark.parametrize("bad", ["missing", "binary"])
def test_train_with_bad_corpus_is_one_line_and_starts_no_run(tmp_path, tiny_model_dir, capsys, bad):
    from cli.main import main

    path = tmp_path / "c.md"
    if bad == "binary":
        path.write_bytes(b"\x00\x01\x02binary")
    code = main(["train", "--model", str(tiny_model_dir), "--corpus", str(path), "--store", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and str(path) in err and len(err.splitlines()) == 1
    assert not (tmp_path / "s" / "catalog.duckdb").exists() or Store(tmp_path / "s").catalog.artifacts() == []


def test_teacher_reads_bot_bs_kept_targets_and_draft_ref_embeds_the_corpus(tmp_path, corpus):
    import pyarrow as pa

    from cartridges.core.files import load_cartridge
    from schemas import TABLES
    from stages.teacher import target_rows

    lm, store = tiny_llama(), Store(tmp_path / "store")
    cfg = preset("smoke", {"synth": {"filter": False}, "train": {"draft_ref": True}})
    summary = run_pipeline(store, lm, [corpus], cfg, save=tmp_path / "out.safetensors")
    convs = store.table(store.latest("synthesize")).to_pylist()
    assert all(c["answer_topk_ids"] for c in convs if c["a_tokens"])  # bot B kept its targets
    # The stage's table equals a forward over every conversation (kept entries dropped).
    stripped = [{**c, "answer_topk_ids": None, "answer_topk_logprobs": None} for c in convs if c["a_tokens"]]
    forward = pa.Table.from_pylist(target_rows(lm, stripped, cfg.teacher), schema=TABLES["targets"]).to_pylist()
    stored = store.table(store.latest("teacher")).to_pylist()
    key = lambda r: (r["conv_id"], r["position"])  # noqa: E731
    assert [key(r) for r in sorted(stored, key=key)] == [key(r) for r in sorted(forward, key=key)]
    for a, b in zip(sorted(stored, key=key), sorted(forward, key=key), strict=True):
        assert a["topk_ids"][0] == b["topk_ids"][0]
        assert a["topk_logprobs"][0] == pytest.approx(b["topk_logprobs"][0], abs=1e-4)
    cart = load_cartridge(summary["cartridge"])
    expected = lm.tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    assert cart.meta["draft_reference"].tolist() == expected


def test_snapkv_questions_init_observes_the_runs_own_questions(tmp_path, corpus):
    # Reference: the same run with SnapKV observing the corpus's tail instead; only the init differs.
    from cartridges.core.files import load_cartridge

    lm = tiny_llama()
    runs = {init: run_pipeline(Store(tmp_path / init), lm, [corpus], smoke(init=init, p=48),
                               save=tmp_path / f"{init}.safetensors")
            for init in ("snapkv", "snapkv_questions")}
    assert runs["snapkv_questions"]["init"] == "snapkv_questions"
    carts = {init: load_cartridge(tmp_path / f"{init}.safetensors") for init in runs}
    assert carts["snapkv_questions"].frozen == carts["snapkv"].frozen == 24
    assert any(not torch.allclose(a[1], b[1]) for a, b in
               zip(carts["snapkv_questions"].rows(), carts["snapkv"].rows(), strict=True))
