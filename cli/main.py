"""The `cartridges` command line. User errors print one clear line; `--debug` shows tracebacks."""

from __future__ import annotations

import argparse
import logging
import sys

from cartridges.core.errors import CartridgeError
from cartridges.evaluation.arms import ARMS as EVAL_ARMS
from cli.common import (
    COMMANDS,
    add_common,
    add_model_args,
    add_runner_args,
    check_runner,
    command,
    emit_json,
)
from cli.fleet import add_parsers, ask_fleet
from cli.options import add_options, config_from, given
from cli.store import add_parsers as add_store_parsers
from schemas.configs import PipelineConfig
from schemas.presets import PRESETS, preset
from stages.graph import NAMES as STAGES


@command("equiv")
def cmd_equiv(args: argparse.Namespace) -> int:
    from cartridges.core.corpus import corpus_text
    from cartridges.core.models import load_model
    from cartridges.evaluation.equiv import equivalence

    text = corpus_text(args.corpus)
    lm = load_model(args.model, args.device, args.dtype)
    print(f"model {lm.name} loaded in {lm.load_seconds:.1f}s ({lm.dtype}, {lm.device})", flush=True)
    r = equivalence(lm, text, args.p, args.suffix_max, args.parts)
    print(f"prefix rows {r['prefix_rows']} ({r['parts']} part(s) of p={r['p']}), suffix tokens {r['n']}")
    print(f"max |dlogit| {r['max_abs_dlogit']:.3e} (tolerance {r['tolerance']:.1e})")
    ties = f" ({r['greedy_ties']} of the differences at near-ties within the tolerance)" if r["greedy_ties"] else ""
    print(f"greedy agreement {r['greedy_agree']}/{r['n']}{ties}")
    print(("PASS" if r["pass"] else "FAIL") + ": untrained corpus-init cartridge vs real prefill")
    r.update(load_seconds=lm.load_seconds, **lm.dtype_record())
    emit_json(args, r)
    return 0 if r["pass"] else 1


@command("model")
def cmd_model(args: argparse.Namespace) -> int:
    from cartridges.core.models import load_model

    lm = load_model(args.model, args.device, args.dtype)
    fp = lm.fingerprint
    heads = {tuple(g) for g in fp["layers"]}
    print(f"model {lm.name}: {fp['architecture']}, {len(fp['layers'])} layers, KV geometry {sorted(heads)}")
    print(f"loaded in {lm.load_seconds:.1f}s on {lm.device} ({lm.dtype}); context {lm.context_length} tokens")
    print(f"fingerprint config {fp['config_hash']} tokenizer {fp['tokenizer_hash']} weights {fp['weights_hash']}")
    print(f"dtype {lm.dtype_record()['dtype']}: {lm.dtype_reason}")
    emit_json(args, {"model": lm.name, "load_seconds": lm.load_seconds, "fingerprint": fp, **lm.dtype_record()})
    return 0


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", action="append", help="text file or directory (repeatable)")
    parser.add_argument("--preset", default="default",
                        help=f"budget preset: {', '.join(PRESETS)} (schemas/presets.py); flags given override it")
    parser.add_argument("--store", default=None, help="artifact store root (default $CARTRIDGES_HOME or ./artifacts)")
    add_options(parser, PipelineConfig)


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    return config_from(args, PipelineConfig, preset, args.preset)


def require_corpus(args: argparse.Namespace) -> list[str]:
    if not args.corpus:
        raise CartridgeError("--corpus is required (a text file or a directory of .md/.txt files)")
    return args.corpus


@command("train")
def cmd_train(args: argparse.Namespace) -> int:
    from cartridges.core.corpus import expand, read_text
    from jobs.report import summary_lines

    corpus = require_corpus(args)
    cfg = pipeline_config(args)
    for path in expand(corpus, cfg.ingest.extensions):  # bad input fails here, before any run starts
        read_text(path, cfg.ingest.max_bytes)
    force = list(STAGES) if args.force_all else (args.force or [])
    check_runner(args)
    if args.no_prefect:
        from cartridges.core.models import load_model
        from jobs.pipeline import run_pipeline
        from stages.fanout import in_process
        from storage import Store

        lm = load_model(args.model, args.device, args.dtype)
        summary = run_pipeline(Store(args.store), lm, corpus, cfg, save=args.save, force=tuple(force),
                               fanout=in_process(lm, args.model, args.device))
    else:
        from flows.cartridge import cartridge_flow
        from flows.ephemeral import server_errors

        with server_errors():
            summary = cartridge_flow(corpus=[str(c) for c in corpus], config=cfg.to_dict(), model=args.model,
                                     device=args.device, dtype=args.dtype, store_root=args.store, save=args.save,
                                     force=force, task_runner=args.task_runner, dask_address=args.dask_address)
    losses = summary.get("losses") or []
    for i, loss in enumerate(losses):
        print(f"step {i:4d}  loss {loss:.4f}")
    for line in summary_lines(summary):
        print(line)
    emit_json(args, summary)
    return 0 if summary.get("health", "ok") == "ok" else 3


@command("stage")
def cmd_stage(args: argparse.Namespace) -> int:
    from cartridges.core.models import load_model
    from stages.graph import stage
    from stages.job import Job
    from storage import Store

    store = Store(args.store)
    cfg = pipeline_config(args)
    if "minutes" not in given(args, PipelineConfig).get("budget", {}):  # a preset's time budget sizes whole runs
        cfg = cfg.replace(budget=cfg.budget.replace(minutes=None))
    budgets = [f"budget.{name}" for name, value in cfg.budget.to_dict().items() if value is not None]
    if budgets:  # budgets size a whole run from the corpus or the machine, before its first stage
        raise CartridgeError(f"stage {args.name}: {', '.join(budgets)} sizes a whole run (`cartridges train`); "
                             "give --p and --conversations to run one stage")
    step = stage(args.name)
    inputs = [store.latest(name) for name in step.inputs]
    missing = [name for name, art in zip(step.inputs, inputs, strict=True) if art is None]
    if missing:
        raise CartridgeError(f"stage {args.name} needs a complete '{missing[0]}' artifact; run that stage first")
    corpus = () if step.inputs else tuple(require_corpus(args))  # the first stage reads the corpus
    lm = load_model(args.model, args.device, args.dtype)  # every stage needs at least its tokenizer
    job = Job(store, lm, corpus, force=frozenset({args.name} if args.force_stage else ()))
    res = step.run(job, step.section(cfg), *inputs)
    state = "skipped (unchanged)" if res.skipped else "done"
    print(f"{args.name}: {state}; artifact {res.id}, {res.rows} rows, {store.dir(res)}")
    emit_json(args, {"stage": args.name, "artifact": res.id, "skipped": res.skipped, "rows": res.rows,
                     "path": str(store.dir(res))})
    return 0


@command("runs")
def cmd_runs(args: argparse.Namespace) -> int:
    from storage import Store, format_table

    store = Store(args.store)
    runs = store.catalog.runs()
    print(format_table(["run_id", "flow", "status", "started_at", "finished_at"],
                       [(r["run_id"], r["flow"], r["status"], r["started_at"], r["finished_at"]) for r in runs]))
    arts = store.catalog.artifacts()
    print()
    print(format_table(["artifact", "stage", "status", "rows", "seconds", "run_id"],
                       [(a.id, a.stage, a.status, a.rows, f"{a.seconds or 0:.1f}", a.run_id) for a in arts]))
    emit_json(args, {"runs": runs, "artifacts": [{"id": a.id, "stage": a.stage, "status": a.status, "rows": a.rows} for a in arts]})
    return 0


@command("sql")
def cmd_sql(args: argparse.Namespace) -> int:
    from storage import Store, format_table, query

    store = Store(args.store, read_only=True)
    columns, rows = query(store.root, args.query)
    print(format_table(columns, rows))
    emit_json(args, {"columns": columns, "rows": [list(r) for r in rows]})
    return 0


@command("ask")
def cmd_ask(args: argparse.Namespace) -> int:
    from cartridges.evaluation.ask import ask_arms

    question = args.question or args.question_text
    if not question:
        raise CartridgeError("a question is required (positional or --question)")
    if args.fleet:
        return ask_fleet(args, question)
    results = ask_arms(args.model, args.device, args.cartridge or [], question, args.corpus or [], args.max_new,
                       args.dtype)
    for arm in results:
        cut = f" (corpus cut by {arm['corpus_tokens_cut']} tokens to fit the window)" if arm.get("corpus_tokens_cut") else ""
        print(f"--- {arm['arm']}: {arm['kv_rows']} KV rows, time to first token {arm['ttft_s'] * 1000:.0f} ms{cut}")
        print(arm["answer"])
    emit_json(args, {"question": question, "arms": results})
    return 0


@command("eval")
def cmd_eval(args: argparse.Namespace) -> int:
    from cartridges.core.models import load_model
    from cartridges.evaluation.qa import read_questions
    from stages import evaluate
    from storage import Store

    questions, problems = read_questions(args.qa)
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    if not args.cartridge and not args.corpus and not args.fleet:
        raise CartridgeError("eval: give --cartridge FILE, --fleet DIR and/or --corpus PATH (nothing to compare)")
    if args.cartridge and args.fleet:
        raise CartridgeError("eval: give --cartridge or --fleet, not both")
    lm = load_model(args.model, args.device, args.dtype)
    result = evaluate.run(Store(args.store), lm, args.qa, questions, problems, args.cartridge or [],
                          args.corpus or [], max_new=args.max_new, peers=not args.no_peers, force=args.force,
                          rag_chunk=args.rag_chunk, skip=tuple(args.skip or ()),
                          log=lambda line: print(line, file=sys.stderr), fleet_dir=args.fleet)
    print(evaluate.markdown_report(result))
    print(f"report: {result['report']}  chart: {result['chart']}"
          + ("  (unchanged: reused the earlier eval)" if result["skipped"] else ""))
    emit_json(args, {**result, **lm.dtype_record()})
    return 0


@command("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    from server.main import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cartridges", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("equiv", help="equivalence gate: untrained cartridge vs real prefill")
    add_model_args(p)
    p.add_argument("--corpus", action="append", required=True, help="text file or directory (repeatable)")
    p.add_argument("--p", type=int, default=256, help="prefix rows per part")
    p.add_argument("--suffix-max", type=int, default=128, help="corpus tokens scored after the prefix")
    p.add_argument("--parts", type=int, default=1, help="cut the capture into this many composed parts")
    add_common(p)

    p = sub.add_parser("model", help="load a model (converting the default once) and show its fingerprint")
    add_model_args(p)
    add_common(p)

    p = sub.add_parser("train", help="run the cartridge flow: corpus -> trained cartridge")
    add_model_args(p)
    add_pipeline_args(p)
    p.add_argument("--save", default=None, help="copy the trained cartridge to this path")
    p.add_argument("--force", action="append", choices=STAGES, help="compute this stage afresh (no fingerprint hit, no shards resumed or copied in)")
    p.add_argument("--force-all", action="store_true", help="recompute every stage")
    p.add_argument("--no-prefect", action="store_true", help="call the stages directly, without a Prefect flow run")
    add_runner_args(p)
    add_common(p)

    p = sub.add_parser("stage", help="run one stage against the latest complete upstream artifacts")
    p.add_argument("name", choices=STAGES)
    add_model_args(p)
    add_pipeline_args(p)
    p.add_argument("--force", action="store_true", dest="force_stage", help="compute afresh (no fingerprint hit, no shards resumed or copied in)")
    add_common(p)

    p = sub.add_parser("runs", help="list runs and artifacts with their status")
    p.add_argument("--store", default=None)
    add_common(p)

    p = sub.add_parser("sql", help="query the catalog: one view per table (latest complete version)")
    p.add_argument("query")
    p.add_argument("--store", default=None)
    add_common(p)

    p = sub.add_parser("eval", help="score a question file: bare, in-context, full-KV, cartridge, peers")
    add_model_args(p)
    p.add_argument("--qa", required=True, help="question file (.jsonl): multiple choice or free form")
    p.add_argument("--cartridge", action="append", help="cartridge file (repeat to compose, in order)")
    p.add_argument("--fleet", default=None, help="fleet directory: retrieval and oracle-selection arms")
    p.add_argument("--corpus", action="append", help="documents for the in-context and full-KV arms")
    p.add_argument("--max-new", type=int, default=48, help="token budget of generated answers")
    p.add_argument("--no-peers", action="store_true", help="skip the KV-compression peer arms")
    p.add_argument("--skip", nargs="+", metavar="ARM", choices=EVAL_ARMS,
                   help=f"skip these arms ({', '.join(EVAL_ARMS)})")
    p.add_argument("--rag-chunk", type=int, default=128,
                   help="tokens per corpus chunk of the retrieval arms (rag: BM25, rag_dense: embeddings)")
    p.add_argument("--force", action="store_true", help="rerun even when an identical eval exists")
    p.add_argument("--store", default=None, help="artifact store root (default $CARTRIDGES_HOME or ./artifacts)")
    add_common(p)

    p = sub.add_parser("ask", help="answer behind cartridge(s), bare, and with the corpus in context")
    add_model_args(p)
    p.add_argument("--cartridge", action="append", help="cartridge file (repeat to compose, in order)")
    p.add_argument("--corpus", action="append", help="corpus for the in-context arm")
    p.add_argument("--question", "-q", default=None)
    p.add_argument("question_text", nargs="?", default=None, help="the question (or --question)")
    p.add_argument("--fleet", default=None, help="fleet directory: answer behind its selected cartridges")
    p.add_argument("--rag-docs", type=int, default=None, help="documents to compose (default: the fleet's rag_docs)")
    p.add_argument("--oracle", action="append", help="bypass retrieval: compose this document (repeatable)")
    p.add_argument("--max-new", type=int, default=128)
    add_common(p)

    add_parsers(sub)
    add_store_parsers(sub)

    from server.options import add_serve_args

    p = sub.add_parser("serve", help="OpenAI-compatible server answering behind cartridge(s)")
    add_model_args(p)
    add_serve_args(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from cli.stops import exit_code, polite_stops, rounds_now, stop_message

    before = rounds_now(args)
    if not args.debug:
        for name in PREFECT_RUN_LOGGERS:
            logging.getLogger(name).addFilter(_no_traceback_for_user_errors)
    try:
        if hasattr(args, "dtype"):  # a command that loads a model: threads for the cores free now
            from cartridges.core.speed import choose_threads

            choose_threads()
        with polite_stops(args.command):
            return COMMANDS[args.command](args)
    except Exception as exc:
        if args.debug or not _user_error(exc):
            raise
        hint = " (disk full: free space and rerun the command; finished work is kept)" if isinstance(
            exc, OSError) else ""
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM during a long command (cli/stops.py)
        print(stop_message(args, exc, before), file=sys.stderr)
        return exit_code(exc)


# Prefect logs a failed flow or task run's exception with its traceback; for a user error the
# command prints one line instead, so those records keep their message and lose the traceback.
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def _no_traceback_for_user_errors(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, Exception) and _user_error(exc):
        record.exc_info, record.exc_text = None, None
    return True


def _user_error(exc: Exception) -> bool:
    """Errors whose message names the file and the fix: no traceback for these."""
    import errno

    kinds = [CartridgeError]
    for module, name in (("storage.errors", "StoreError"), ("schemas.configs", "ConfigError")):
        kind = getattr(sys.modules.get(module), name, None)  # loaded iff such an error can occur
        if kind is not None:
            kinds.append(kind)
    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return full or isinstance(exc, tuple(kinds))


if __name__ == "__main__":
    sys.exit(main())
