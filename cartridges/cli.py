"""The `cartridges` command line. User errors print one clear line; `--debug` shows tracebacks."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from cartridges.errors import CartridgeError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn

    return register


def emit_json(args: argparse.Namespace, obj: dict) -> None:
    """With --json, the last printed line is one JSON object."""
    if getattr(args, "json", False):
        print(json.dumps(obj, default=str), flush=True)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir, .gguf file, or cached hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when present)")


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


@command("equiv")
def cmd_equiv(args: argparse.Namespace) -> int:
    from cartridges.corpus import corpus_text
    from cartridges.equiv import equivalence
    from cartridges.models import load_model

    text = corpus_text(args.corpus)
    lm = load_model(args.model, args.device)
    print(f"model {lm.name} loaded in {lm.load_seconds:.1f}s ({lm.dtype}, {lm.device})", flush=True)
    r = equivalence(lm, text, args.p, args.suffix_max, args.parts)
    print(f"prefix rows {r['prefix_rows']} ({r['parts']} part(s) of p={r['p']}), suffix tokens {r['n']}")
    print(f"max |dlogit| {r['max_abs_dlogit']:.3e} (tolerance {r['tolerance']:.1e})")
    print(f"greedy agreement {r['greedy_agree']}/{r['n']}")
    print(("PASS" if r["pass"] else "FAIL") + ": untrained corpus-init cartridge vs real prefill")
    r["load_seconds"] = lm.load_seconds
    emit_json(args, r)
    return 0 if r["pass"] else 1


@command("model")
def cmd_model(args: argparse.Namespace) -> int:
    from cartridges.models import load_model

    lm = load_model(args.model, args.device)
    fp = lm.fingerprint
    heads = {tuple(g) for g in fp["layers"]}
    print(f"model {lm.name}: {fp['architecture']}, {len(fp['layers'])} layers, KV geometry {sorted(heads)}")
    print(f"loaded in {lm.load_seconds:.1f}s on {lm.device} ({lm.dtype}); context {lm.context_length} tokens")
    print(f"fingerprint config {fp['config_hash']} tokenizer {fp['tokenizer_hash']} weights {fp['weights_hash']}")
    emit_json(args, {"model": lm.name, "load_seconds": lm.load_seconds, "fingerprint": fp})
    return 0


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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except CartridgeError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
