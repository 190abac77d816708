"""Eval: score a question file on every arm and record it (``evals`` table, report, chart).

Arms: ``bare`` (nothing in front), ``icl`` (the question's document in context,
cut to the window), ``full_kv`` (that document's exact prefill KV written as a
cartridge file and served on the cartridge path: the control that must score
like ``icl``), ``cartridge`` (the files given, composed in order), and
compression peers at the cartridge's KV budget (``knorm``: per layer and head,
the lowest-norm keys of the full KV, re-rotated to contiguous positions; ``snapkv``:
the rows the document's last tokens attend to most, re-rotated likewise; ``first``:
its first rows, i.e. the untrained corpus-init cartridge). An unchanged eval (same question file,
cartridges, corpus, model and settings) is a fingerprint hit and is not rerun.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import torch

from cartridges.core.cartridge import Cartridge, compose_rows
from cartridges.core.compress import first_rows, knorm_rows, rotary_of, snapkv_rows
from cartridges.core.corpus import expand, read_text
from cartridges.core.errors import CorpusError
from cartridges.core.files import check_fits, load_cartridge, save_cartridge
from cartridges.core.models import LoadedModel
from cartridges.core.prefix import Rows, capture_rows, prefix_length
from cartridges.evaluation.arms import ARMS, PEERS, RAG
from cartridges.evaluation.evaluate import (
    Arm,
    Scored,
    cached,
    closure,
    document_context,
    score_arm,
    summarize_arm,
)
from cartridges.evaluation.qa import Question
from cartridges.evaluation.retrieval import Retriever, context_ids, corpus_chunks, fill
from schemas import EVALS
from stages.progress import progress
from storage import StageContext, Store
from storage.faults import fault_point

NAME = "eval"
VERSION = 6
ANSWER_RESERVE = 256  # positions kept free after the ICL context for the question and answer
RAG_CHUNK = 128  # tokens per retrieved chunk
REUSABLE = ("bare", "icl", "icl_window", "full_kv", *PEERS, *RAG)
CLOSURES = ("icl_gap_closure", "icl_gap_closure_nll", "oracle_gap_closure", "oracle_gap_closure_nll")
ARM_STAGE, ARM_FILE = "eval_arm", "scored.json"
CORPUS_KEY = "*corpus*"  # the whole corpus, as opposed to one document of it
SCORED_FIELDS = ("correct", "correct_gen", "hit_limit", "nll", "gold_nll", "kv_rows", "reply")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Inputs:
    """Arms over a model, cartridge files and documents; contexts and full KVs built once."""

    def __init__(self, lm: LoadedModel, cartridges: list[str], docs: dict[str, str], fleet=None,
                 rag_chunk: int = RAG_CHUNK, budget: int | None = None) -> None:
        """`budget`: the rows the peers and retrieval hold when no cartridge sets them."""
        self.lm, self.docs, self.fleet, self.rag_chunk = lm, docs, fleet, rag_chunk
        self.selected: dict[str, list[str]] = {}  # question -> documents retrieved for it
        self.truncated: dict[str, int] = {}  # document -> context tokens cut to fit the window
        self.parts = []
        for path in cartridges:
            cart = load_cartridge(path, device=lm.device, dtype=lm.dtype)
            check_fits(cart, lm.fingerprint, path)
            self.parts.append(cart)
        self.budget = sum(c.p for c in self.parts) or budget
        self.rotary = rotary_of(lm.model)
        self.context = cached(self._context)
        self.full_kv = cached(self._full_kv)
        # a peer's rows are needed once per group and again for TTFT: select them once per document
        self.knorm = cached(lambda key: knorm_rows(self.full_kv(key), self.budget, self.rotary))
        self.snapkv = cached(self._snapkv)
        self.retriever = cached(self._retriever)

    def doc_key(self, q: Question) -> str:
        """The document a question is asked against; the whole corpus when it names none."""
        return q.doc if q.doc in self.docs else CORPUS_KEY

    def _context(self, key: str) -> list[int]:
        text = self.docs.get(key) or "\n".join(self.docs.values())
        ids, cut = document_context(self.lm, text, ANSWER_RESERVE)
        self.truncated[key] = cut
        return ids

    def _full_kv(self, key: str):
        """The context's exact KV, round-tripped through a cartridge file."""
        lm = self.lm
        rows = capture_rows(lm.model, torch.tensor(self.context(key), device=lm.device))
        with tempfile.TemporaryDirectory() as tmp:
            path = save_cartridge(Path(tmp) / "full.safetensors", Cartridge.from_rows(rows, frozen=0),
                                  lm.fingerprint, init="full_kv")
            return load_cartridge(path, device=lm.device, dtype=lm.dtype).rows()

    def _snapkv(self, key: str):
        rows = self.full_kv(key)
        ids = torch.tensor(self.context(key), device=self.lm.device)
        return snapkv_rows(self.lm.model, ids, rows, self.budget, self.rotary)

    def _retriever(self, kind: str) -> Retriever:
        chunks = corpus_chunks(self.lm.tokenizer, list(self.docs.values()), self.rag_chunk)
        return Retriever(chunks, kind, self.lm.model, self.lm.tokenizer)

    def rag_context(self, kind: str, q: Question, rows: int | None = None) -> list[int]:
        """The corpus chunks `kind` ranks best for the question, filling `rows` (the budget)."""
        retriever = self.retriever(kind)
        budget = self.budget if rows is None else rows
        return fill(self.lm.tokenizer, retriever.chunks, retriever.rank(q.question), budget)[1]

    def rag_beside(self, name: str, rows_of: Callable[[Question], Rows], kind: str = "bm25") -> Arm:
        """`rows_of`'s prefix rows, then the chunks `kind` ranks best in what they leave of the budget."""
        def context(q: Question) -> list[int]:
            return self.rag_context(kind, q, self.budget - prefix_length(rows_of(q)))
        return Arm(name, key=lambda q: q.question, rows=rows_of, context=context)

    def retrieve(self, q: Question) -> list[str]:
        if q.question not in self.selected:
            self.selected[q.question] = self.fleet.select(q.question)
        return self.selected[q.question]

    def fleet_arms(self, questions: list[Question]) -> tuple[list[Arm], list[str]]:
        """Retrieval (the fleet's own index picks `rag_docs` documents) and oracle selection."""
        fleet = self.fleet
        arms = [Arm("fleet_retrieval", key=lambda q: ",".join(self.retrieve(q)),
                    rows=lambda q: fleet.rows(self.retrieve(q)))]
        missing = sorted({str(q.doc) for q in questions if q.doc not in fleet.names})
        if missing:
            return arms, [f"no fleet_oracle arm: questions name documents the fleet lacks: {', '.join(missing)}"]
        arms.append(Arm("fleet_oracle", key=lambda q: q.doc, rows=lambda q: fleet.rows([q.doc])))
        return arms, []

    def arms(self, peers: bool = True, questions: list[Question] = ()) -> list[Arm]:
        """`icl` and its control `full_kv` see the question's own document (on a corpus of several,
        the oracle's pick) or else the corpus; `icl_window` (a corpus of several documents, questions
        naming theirs) and every peer see what a user has: the corpus, cut to the window."""
        arms = [Arm("bare", key=lambda q: "", rows=lambda q: [])]
        key = self.doc_key
        corpus = CORPUS_KEY
        if self.docs:
            arms.append(Arm("icl", key=key, context=lambda q: self.context(key(q))))
            arms.append(Arm("full_kv", key=key, rows=lambda q: self.full_kv(key(q))))
            if len(self.docs) > 1 and any(q.doc in self.docs for q in questions):
                arms.append(Arm("icl_window", key=lambda q: corpus, context=lambda q: self.context(corpus)))
        if self.parts:
            rows = compose_rows(self.parts)
            arms.append(Arm("cartridge", key=lambda q: "", rows=lambda q: rows))
        if self.budget and self.docs and peers:
            arms.append(Arm("knorm", key=lambda q: corpus, rows=lambda q: self.knorm(corpus)))
            arms.append(Arm("snapkv", key=lambda q: corpus, rows=lambda q: self.snapkv(corpus)))
            arms.append(Arm("first", key=lambda q: corpus,
                            rows=lambda q: first_rows(self.full_kv(corpus), self.budget)))
        if self.budget and self.docs and len(context_ids(self.lm.tokenizer, [])) < self.budget:
            for name, kind in RAG.items():
                arms.append(Arm(name, key=lambda q: q.question,
                                context=lambda q, kind=kind: self.rag_context(kind, q)))
        return arms


def select_questions(questions: list[Question], docs: dict[str, str]) -> tuple[list[Question], list[str]]:
    """Questions this corpus can answer, and a note per skipped group."""
    if not docs:
        return questions, []
    keep = [q for q in questions if q.doc is None or q.doc in docs]
    others = sorted({q.doc for q in questions if q.doc is not None and q.doc not in docs})
    notes = [f"skipped {len(questions) - len(keep)} questions about documents not in the corpus: "
             + ", ".join(others)] if others else []
    return keep, notes


def read_docs(corpus: list[str]) -> dict[str, str]:
    """Document name (file name) -> text, for matching questions' "doc" fields."""
    docs: dict[str, str] = {}
    for path in expand(corpus):
        if path.name in docs:
            raise CorpusError(f"{path}: two corpus files are named {path.name!r}; questions "
                              "name documents by file name")
        docs[path.name] = read_text(path)
    return docs


def _evals_rows(run_id: str, result: dict) -> list[dict]:
    """One row per arm and metric; the closures are rows of the arm they measure."""
    rows = []
    for arm, res in result["arms"].items():
        for metric in ("accuracy", "accuracy_gen", "gold_nll", "answer_nll", "kv_rows", "kv_bytes", "ttft_s",
                       "hit_limit"):
            if metric in res and res[metric] is not None:
                n = res.get("multiple_choice") or res.get("free_form") or res["questions"]
                details = {k: res[k + "_ci"] for k in (metric,) if k + "_ci" in res}
                rows.append({"run_id": run_id, "arm": arm, "metric": metric, "value": float(res[metric]),
                             "n": int(n), "details": json.dumps(details)})
    for name in CLOSURES:
        c = result.get(name)
        if c and c["value"] is not None:
            rows.append({"run_id": run_id, "arm": c["arm"], "metric": name, "value": float(c["value"]),
                         "n": int(result["questions"]), "details": json.dumps({k: c[k] for k in ("metric", "ci")})})
    return rows


def markdown_report(result: dict) -> str:
    """The eval as a markdown table (one row per arm) with the ICL-gap closure."""
    subject = ", ".join(result["cartridges"]) or (f"fleet {result['fleet']}" if result.get("fleet") else "no cartridge")
    lines = [f"# Eval of {subject}", "",
             f"Questions: {result['questions']} from `{result['qa']}`; "
             f"documents: {', '.join(result['docs']) or 'none'}.", "",
             "| arm | accuracy (95% CI) | accuracy_gen (95% CI) | gold NLL (95% CI) | hit limit | answer NLL "
             "| KV rows | KV MiB | TTFT ms |",
             "|---|---|---|---|---|---|---|---|---|"]

    def ci(res: dict, name: str, fmt: str = ".1%", bound: str = ".0%") -> str:
        if name not in res:
            return "n/a"
        lo, hi = res[name + "_ci"]
        return f"{res[name]:{fmt}} ({lo:{bound}}-{hi:{bound}})"
    for arm, res in result["arms"].items():
        nll = f"{res['answer_nll']:.3f}" if "answer_nll" in res else "n/a"
        lines.append(f"| {arm} | {ci(res, 'accuracy')} | {ci(res, 'accuracy_gen')} "
                     f"| {ci(res, 'gold_nll', '.3f', '.3f')} | {res.get('hit_limit', 'n/a')} "
                     f"| {nll} | {res['kv_rows']:.0f} | {res['kv_bytes'] / 2**20:.1f} | {res['ttft_s'] * 1000:.0f} |")
    lines.append("")
    for name, label in (("icl_gap_closure", "ICL-gap closure"), ("icl_gap_closure_nll", "ICL-gap closure"),
                        ("oracle_gap_closure", "ICL-gap closure with oracle selection"),
                        ("oracle_gap_closure_nll", "ICL-gap closure with oracle selection")):
        if result.get(name):
            lines.append(f"{label} ({result[name]['metric']}): {_closure_text(result[name])}")
    if result.get("compression"):
        lines.append(f"KV compression vs ICL: {result['compression']:.1f}x fewer rows")
    top1 = result["arms"].get("fleet_retrieval", {}).get("retrieval_top1")
    if top1 is not None:
        lines.append(f"Retrieval top-1 picks the question's document for {top1:.0%} of questions")
    lines += [f"- {n}" for n in result["notes"] if n]
    return "\n".join(lines) + "\n"


def _closure_text(c: dict) -> str:
    if c["value"] is None:
        return f"null ({c['reason']})"
    text = f"{c['value']:.2f}"
    if c.get("ci"):
        text += f" (95% CI {c['ci'][0]:.2f} to {c['ci'][1]:.2f})"
    if c.get("ci_left_out"):
        text += f"; {c['ci_left_out']} of 2000 resamples had no defined closure"
    return text


def chart_png(result: dict, path: Path) -> None:
    """Accuracy per arm with its 95% interval (or answer NLL for free-form sets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["arms"])
    metric = "accuracy" if all("accuracy" in r for r in result["arms"].values()) else "answer_nll"
    values = [result["arms"][n].get(metric, math.nan) for n in names]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.2))
    if metric == "accuracy":
        cis = [result["arms"][n]["accuracy_ci"] for n in names]
        err = [[v - lo for v, (lo, _) in zip(values, cis, strict=True)],
               [hi - v for v, (_, hi) in zip(values, cis, strict=True)]]
        ax.bar(names, values, yerr=err, capsize=4, color="#4a7db3")
        ax.set_ylim(0, 1)
    else:
        ax.bar(names, values, color="#4a7db3")
    ax.set_ylabel(metric)
    ax.set_title(Path(result["qa"]).name)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def scored_arm(store: Store, lm: LoadedModel, arm: Arm, used: list[Question], max_new: int, config: dict,
               budget: int | None, force: bool, run_id: str | None) -> tuple[list[Scored], float, bool]:
    """Score one arm; an arm that does not depend on the cartridges (bare, in-context, full KV,
    peers at the same budget) is an artifact of its own, reused by later evals of other cartridges."""
    if arm.name not in REUSABLE:
        with progress(len(used), f"eval {arm.name}", "question") as bar:
            return (*score_arm(lm, arm, used, max_new=max_new, progress=bar.update), False)
    key = {k: config[k] for k in ("qa", "docs", "model", "max_new")}
    key.update(arm=arm.name, budget=budget if arm.name in PEERS or arm.name in RAG else None,
               questions=[q.line for q in used])
    if arm.name in RAG:
        key["rag_chunk"] = config["rag_chunk"]
    out: dict = {}

    def work(ctx: StageContext) -> None:
        with progress(len(used), f"eval {arm.name}", "question") as bar:
            def step(n: int) -> None:
                bar.update(n)
                fault_point(f"eval.question.{arm.name}")  # one question scored, the arm not yet

            scored, ttft = score_arm(lm, arm, used, max_new=max_new, progress=step)
        out.update(scored=scored, ttft=ttft)
        rows = [{f: getattr(s, f) for f in SCORED_FIELDS} for s in scored]
        ctx.write_file(ARM_FILE, json.dumps({"ttft": ttft, "rows": rows}).encode())

    res = store.run(ARM_STAGE, VERSION, key, [], work, force=force, run_id=run_id)
    if out:
        return out["scored"], out["ttft"], False
    data = json.loads((store.dir(res) / ARM_FILE).read_text())
    return [Scored(q, **row) for q, row in zip(used, data["rows"], strict=True)], data["ttft"], True


def score_arms(store: Store, lm: LoadedModel, plan: list[Arm], used: list[Question], max_new: int, config: dict,
               budget: int | None, force: bool, run_id: str | None, log) -> tuple[dict, dict, list, list]:
    """Each arm's summary, its scored answers, the per-question rows, and the arms reused."""
    arms, by_arm, answers, reused = {}, {}, [], []
    for arm in plan:
        log(f"eval: arm {arm.name} ({len(used)} questions)")
        scored, ttft, skipped = scored_arm(store, lm, arm, used, max_new, config, budget, force, run_id)
        if skipped:
            reused.append(arm.name)
        arms[arm.name], by_arm[arm.name] = summarize_arm(lm, arm.name, scored, ttft, arm.notes), scored
        answers += [{"arm": arm.name, "line": s.question.line, "doc": s.question.doc,
                     "region": s.question.region, "question": s.question.question,
                     "correct": s.correct, "correct_gen": s.correct_gen, "reply": s.reply,
                     "nll": s.nll, "gold_nll": s.gold_nll} for s in scored]
    return arms, by_arm, answers, reused


def run_notes(problems: list[str], reused: list[str], truncated: dict[str, int], window: int) -> list[str]:
    notes = [f"{problem} (skipped)" for problem in problems]
    if reused:
        notes.append(f"arms reused from an identical earlier scoring (TTFT as measured then): {', '.join(reused)}")
    notes += [f"ICL context of {'the corpus' if d == CORPUS_KEY else d} cut by {n} tokens to fit the "
              f"{window}-token window" for d, n in truncated.items() if n]
    return notes


def closures(by_arm: dict, main: str, multiple_choice: bool) -> dict:
    """How much of the gap to in-context (and, for fleets, to the oracle pick) `main` closes,
    in accuracy and in the correct option's NLL."""
    out = {}
    for prefix, candidate in (("icl", main), ("oracle", "fleet_oracle")):
        if prefix == "oracle" and candidate not in by_arm:
            continue
        out[f"{prefix}_gap_closure"] = {**closure(by_arm, candidate), "arm": candidate}
        out[f"{prefix}_gap_closure_nll"] = (
            {**closure(by_arm, candidate, "gold_nll"), "arm": candidate} if multiple_choice else
            {"value": None, "reason": "no multiple-choice questions", "metric": "gold_nll", "ci": None,
             "arm": candidate})
    return out


def write_outputs(ctx: StageContext, result: dict, answers: list[dict], run_id: str) -> None:
    """The `evals` rows, result.json, answers.jsonl, report.md and chart.png."""
    ctx.write_shard(0, pa.Table.from_pylist(_evals_rows(run_id, result), schema=EVALS))
    ctx.write_file("result.json", json.dumps(result, indent=1).encode())
    ctx.write_file("answers.jsonl", "".join(json.dumps(a) + "\n" for a in answers).encode())
    ctx.write_file("report.md", markdown_report(result).encode())
    with ctx.atomic_path("chart.png") as tmp:
        chart_png(result, tmp)


def run(store: Store, lm: LoadedModel, qa: str, questions: list[Question], problems: list[str],
        cartridges: list[str], corpus: list[str], max_new: int = 48, peers: bool = True, rag_chunk: int = RAG_CHUNK,
        force: bool = False, run_id: str | None = None, log=print, fleet_dir: str | None = None,
        skip: tuple[str, ...] = ()) -> dict:
    """Score every arm but those in `skip` (or reuse an identical earlier eval) and return the result dict."""
    unknown = sorted(set(skip) - set(ARMS))
    if unknown:
        raise ValueError(f"eval: no arm named {', '.join(unknown)} (arms: {', '.join(ARMS)})")
    docs = read_docs(corpus) if corpus else {}
    fleet = None
    if fleet_dir:
        from cartridges.fleet import Fleet

        fleet = Fleet.open(fleet_dir, lm)
    config = {
        "fleet": (hashlib.sha256(json.dumps(fleet.manifest.to_dict(), sort_keys=True).encode()).hexdigest()
                  if fleet else None),
        "qa": _sha(Path(qa)), "cartridges": [_sha(Path(c)) for c in cartridges],
        "docs": {n: hashlib.sha256(t.encode()).hexdigest() for n, t in docs.items()},
        "model": lm.compute_id, "max_new": max_new, "peers": peers, "rag_chunk": rag_chunk, "skip": sorted(skip),
    }
    result: dict = {}

    def work(ctx: StageContext) -> None:
        used, notes = select_questions(questions, docs)
        if not used:
            raise CorpusError(f"{qa}: none of its questions is about a document in the corpus "
                              f"({', '.join(docs)})")
        inputs = Inputs(lm, cartridges, docs, fleet, rag_chunk)
        plan = inputs.arms(peers, used)
        if fleet is not None:
            extra, why = inputs.fleet_arms(used)
            plan += extra
            notes += why
        plan = [arm for arm in plan if arm.name not in skip]
        arms, by_arm, answers, reused = score_arms(store, lm, plan, used, max_new, config, inputs.budget, force,
                                                   run_id, log)
        notes += run_notes(problems, reused, inputs.truncated, lm.context_length)
        if fleet is not None:
            named = [q for q in used if q.doc]
            if named:
                hits = [q.doc in inputs.retrieve(q)[:1] for q in named]
                arms["fleet_retrieval"]["retrieval_top1"] = sum(hits) / len(hits)
        main = "cartridge" if "cartridge" in arms else "fleet_retrieval"
        result.update(
            qa=str(qa), cartridges=[str(c) for c in cartridges], fleet=fleet_dir, docs=list(docs),
            questions=len(used), arms=arms, notes=notes,
            compression=(arms["icl"]["kv_rows"] / arms[main]["kv_rows"]
                         if "icl" in arms and main in arms else None),
            **closures(by_arm, main, any(q.multiple_choice for q in used)),
        )
        write_outputs(ctx, result, answers, run_id or ctx.artifact.id)

    out = store.run(NAME, VERSION, config, [], work, force=force, run_id=run_id)
    directory = store.dir(out)
    if not result:
        result.update(json.loads((directory / "result.json").read_text()))
    result.update(skipped=out.skipped, report=str(directory / "report.md"), chart=str(directory / "chart.png"))
    return result
