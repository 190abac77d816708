"""`cartridges fleet` (train, update or re-index a fleet), `cartridges retrain` and `cartridges ask --fleet`."""

from __future__ import annotations

import argparse

from cartridges.core.errors import CartridgeError
from cli.common import (
    add_common,
    add_model_args,
    add_runner_args,
    check_runner,
    command,
    emit_json,
)
from cli.options import add_options, config_from
from schemas.configs import FleetConfig
from schemas.presets import FLEET_PRESETS, fleet_preset


def add_parsers(sub) -> None:
    p = sub.add_parser("fleet", help="train a fleet: one cartridge per document, a retrieval index")
    add_model_args(p)
    p.add_argument("--docs", action="append", nargs="+", help="document files or directories (top-level .md/.txt)")
    p.add_argument("--fleet", required=True, help="fleet directory")
    p.add_argument("--resume", action="store_true", help="continue or update an existing fleet")
    p.add_argument("--preset", default="default",
                   help=f"budget preset: {', '.join(FLEET_PRESETS)} (schemas/presets.py); flags given override it")
    p.add_argument("--store", default=None, help="artifact store root (default $CARTRIDGES_HOME or ./artifacts)")
    add_options(p, FleetConfig, top="fleet")
    p.add_argument("--eval-distractors", type=int, default=0,
                   help="also score each document's held-out loss with this many distractors co-loaded")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="when another run is writing this fleet, wait up to SECONDS for it (default: exit at once)")
    p.add_argument("--no-prefect", action="store_true", help="call the steps directly, without a Prefect flow run")
    add_runner_args(p)
    add_common(p)

    p = sub.add_parser("retrain", help="retrain the changed documents of a published fleet, publish a new version")
    add_model_args(p)
    p.add_argument("--docs", action="append", nargs="+", help="document files or directories (top-level .md/.txt)")
    p.add_argument("--fleet", required=True, help="fleet root: versions/NNNN/ and the current link")
    p.add_argument("--preset", default=None, help="budget preset (default: the live fleet's own config)")
    p.add_argument("--store", default=None, help="artifact store root (default $CARTRIDGES_HOME or ./artifacts)")
    p.add_argument("--serve-url", default=None,
                   help="server to reload after publishing (default $CARTRIDGES_SERVE_URL; key from $CARTRIDGES_API_KEY)")
    p.add_argument("--serve-pid-file", default=None, help="or: send SIGHUP to the server PID in this file")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="when another run is writing this fleet, wait up to SECONDS for it (default: exit at once)")
    add_runner_args(p)
    add_common(p)


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    return config_from(args, FleetConfig, fleet_preset, args.preset)


@command("fleet")
def cmd_fleet(args: argparse.Namespace) -> int:
    from jobs.fleet import check_target, fleet_files
    from jobs.report import summary_lines

    docs = [d for group in (args.docs or []) for d in group]
    if not docs:
        raise CartridgeError("--docs is required: document files or directories")
    cfg = fleet_config(args)
    from cartridges.core.corpus import read_text

    for path in fleet_files(docs, cfg.ingest):  # bad input fails here, before any run starts
        read_text(path, cfg.ingest.max_bytes)
    check_target(args.fleet, args.resume)
    check_runner(args)
    from storage.lock import wait_free

    wait_free(args.fleet, "fleet", args.wait)
    if args.no_prefect:
        from cartridges.core.models import load_model
        from jobs.fleet import run_fleet
        from stages.fanout import in_process
        from storage import Store

        lm = load_model(args.model, args.device, args.dtype)
        summary = run_fleet(Store(args.store), lm, docs, args.fleet, cfg, resume=args.resume,
                            eval_distractors=args.eval_distractors, lock_wait=args.wait,
                            fanout=in_process(lm, args.model, args.device))
    else:
        from flows.ephemeral import server_errors
        from flows.fleet import fleet_flow

        with server_errors():
            summary = fleet_flow(docs=[str(d) for d in docs], fleet=args.fleet, config=cfg.to_dict(), model=args.model,
                                 device=args.device, dtype=args.dtype, store_root=args.store, resume=args.resume,
                                 eval_distractors=args.eval_distractors, task_runner=args.task_runner,
                                 dask_address=args.dask_address, lock_wait=args.wait)
    for line in summary_lines(summary):
        print(line)
    emit_json(args, summary)
    return 0


@command("retrain")
def cmd_retrain(args: argparse.Namespace) -> int:
    from flows.ephemeral import server_errors
    from flows.retrain import retrain_flow

    docs = [d for group in (args.docs or []) for d in group]
    if not docs:
        raise CartridgeError("--docs is required: document files or directories")
    args.no_prefect = False
    check_runner(args)
    from storage.lock import wait_free

    wait_free(args.fleet, "retrain", args.wait)
    with server_errors():
        summary = retrain_flow(docs=[str(d) for d in docs], fleet=args.fleet, preset=args.preset, model=args.model,
                               device=args.device, dtype=args.dtype, store_root=args.store, serve_url=args.serve_url,
                               serve_pid_file=args.serve_pid_file, task_runner=args.task_runner,
                               dask_address=args.dask_address, lock_wait=args.wait)
    print(summary["message"])
    if summary["trained"]:
        print(f"trained: {', '.join(summary['trained'])} ({summary['rounds_run']} rounds)")
    emit_json(args, summary)
    return 0


def ask_fleet(args: argparse.Namespace, question: str) -> int:
    """Answer behind the fleet's selected cartridges, beside the bare answer."""
    from cartridges.core.models import load_model
    from cartridges.evaluation.ask import answer, student_prompt
    from cartridges.fleet.api import Fleet

    lm = load_model(args.model, args.device, args.dtype)
    fleet = Fleet.open(args.fleet, lm)
    if args.oracle:
        for name in args.oracle:
            fleet.manifest.entry(name)
        chosen = [(name, None) for name in args.oracle]
    else:
        chosen = fleet.search(question, args.rag_docs)
    names = [n for n, _ in chosen]
    prompt = student_prompt(lm.tokenizer, question)
    rows = fleet.rows(names)
    text, ttft = answer(lm, prompt, rows, args.max_new)
    bare, bare_ttft = answer(lm, prompt, None, args.max_new)
    how = "oracle" if args.oracle else "retrieved"
    print(f"selected ({how}): " + ", ".join(n if s is None else f"{n} ({s:.3f})" for n, s in chosen))
    print(f"--- fleet: {fleet.prefix_length(names) + len(prompt)} KV rows, time to first token {ttft * 1000:.0f} ms")
    print(text)
    print(f"--- bare: {len(prompt)} KV rows, time to first token {bare_ttft * 1000:.0f} ms")
    print(bare)
    emit_json(args, {"question": question, "selected": names, "scores": [s for _, s in chosen],
                     "selection": how, "answer": text, "bare_answer": bare, "ttft_s": ttft})
    return 0
