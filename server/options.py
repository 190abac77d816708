"""The server's typed config and its command-line options (no web imports here)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_batch: int = 16  # streams decoding at once (resident slots)
    max_queue: int = 64  # requests waiting for a slot; more get 429
    max_tokens_cap: int = 1024  # largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when a request does not say (clamped to the context)
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    max_stop: int = 4  # stop strings per request (as OpenAI)
    name: str | None = None  # model id served at /v1/models (default: the cartridge names)
    spec: int = 0  # greedy requests verify up to this many prompt-lookup draft tokens per step


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    parser.add_argument("--cartridge", action="append", default=None,
                        help="cartridge file (repeat to compose, in order); or --fleet")
    parser.add_argument("--fleet", default=None,
                        help="fleet directory: each conversation sits behind the documents retrieved for it")
    parser.add_argument("--rag-docs", type=int, default=None,
                        help="fleet: documents composed per conversation (default: the fleet's rag_docs)")
    parser.add_argument("--rag-adaptive", action="store_true",
                        help="fleet: retrieve again on each follow-up; switch documents on a decisive margin")
    parser.add_argument("--rag-margin", type=float, default=None,
                        help="fleet with --rag-adaptive: score margin a new document must win by (default 0.05)")
    parser.add_argument("--max-conversations", type=int, default=256,
                        help="fleet: conversations whose selection and KV are kept (least recently used go)")
    parser.add_argument("--max-conversation-rows", type=int, default=32768,
                        help="fleet: KV rows kept over all kept conversations")
    parser.add_argument("--host", default=d.host, help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--api-key", default=os.environ.get("CARTRIDGES_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 and /admin (default: $CARTRIDGES_API_KEY)")
    parser.add_argument("--max-batch", type=int, default=d.max_batch, help="streams decoding at once")
    parser.add_argument("--spec", type=int, default=d.spec, metavar="N",
                        help="greedy requests verify up to N draft tokens per step, looked up in the conversation "
                             "and the cartridge's embedded corpus (train --draft-ref); same output (default 0: off)")
    parser.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting for a slot")
    parser.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap, help="largest max_tokens accepted")
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    parser.add_argument("--name", default=None,
                        help="model id clients use (default: the cartridge file names, or the fleet directory's name)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the cores idle at start, or CARTRIDGES_THREADS)")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    from cartridges.core.errors import CartridgeError

    if bool(args.cartridge) == bool(args.fleet):
        raise CartridgeError("serve needs either --cartridge FILE (repeatable) or --fleet DIR"
                             + (", not both" if args.cartridge else ""))
    if not args.fleet:
        for flag in ("rag_docs", "rag_margin"):
            if getattr(args, flag) is not None:
                raise CartridgeError(f"--{flag.replace('_', '-')} needs --fleet")
        if args.rag_adaptive:
            raise CartridgeError("--rag-adaptive needs --fleet")
    if args.rag_margin is not None and not args.rag_adaptive:
        raise CartridgeError("--rag-margin needs --rag-adaptive")
    if args.rag_docs is not None and args.rag_docs < 1:
        raise CartridgeError(f"--rag-docs must be >= 1, got {args.rag_docs}")
    if args.rag_margin is not None and args.rag_margin < 0:
        raise CartridgeError(f"--rag-margin must be >= 0, got {args.rag_margin}")
    for flag in ("max_batch", "max_queue", "max_tokens_cap", "default_max_tokens", "max_body_bytes",
                 "max_conversations", "max_conversation_rows"):
        if getattr(args, flag) < 1:
            raise CartridgeError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.spec <= 16:
        raise CartridgeError(f"--spec must be in 0..16, got {args.spec}")
    if not 0 <= args.port <= 65535:
        raise CartridgeError(f"--port must be in 0..65535, got {args.port}")
    return ServeConfig(
        host=args.host, port=args.port, api_key=args.api_key, max_batch=args.max_batch, max_queue=args.max_queue,
        max_tokens_cap=args.max_tokens_cap, default_max_tokens=min(args.default_max_tokens, args.max_tokens_cap),
        max_body_bytes=args.max_body_bytes, name=args.name, spec=args.spec,
    )
