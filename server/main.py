"""`cartridges serve`: load the model and cartridges, start the decode loop, run uvicorn.

The socket is bound before uvicorn starts, so a busy port is a one-line error, and
`--port 0` picks a free port (printed). SIGHUP reloads the cartridge files (or the
fleet), like `POST /admin/reload`.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

import uvicorn

from cartridges.core.errors import CartridgeError, CartridgeFileError, FleetError
from cartridges.core.models import LoadedModel, load_model
from server.app import create_app
from server.engine import Engine
from server.errors import shutting_down
from server.options import ServeConfig, serve_config
from server.selector import CartridgeSelector, Selector

GRACE_S = 5.0  # what running answers get on SIGTERM before they end with a 503 error in their stream
BACKSTOP_S = 5.0  # then uvicorn cancels what is still open (it logs a traceback for each)


class _Uvicorn(uvicorn.Server):
    """uvicorn whose shutdown ends the engine's running answers when the grace period is up, so that
    their connections close cleanly before uvicorn's own cancellation."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = threading.Timer(GRACE_S, self.engine.end_all, args=(shutting_down(GRACE_S),))
        timer.daemon = True
        timer.start()
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CartridgeError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class Server:
    """A running server: engine thread plus uvicorn on a bound socket (in this thread or a new one)."""

    def __init__(self, lm: LoadedModel, selector: Selector, config: ServeConfig) -> None:
        self.lm, self.selector, self.config = lm, selector, config
        self.engine = Engine(lm, selector, config)
        self.app = create_app(lm, selector, self.engine, config)
        self.sock = bind(config.host, config.port)
        self.port = self.sock.getsockname()[1]
        self.uvicorn = _Uvicorn(uvicorn.Config(self.app, log_level="warning",
                                               timeout_graceful_shutdown=GRACE_S + BACKSTOP_S), self.engine)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until interrupted (blocking). On SIGTERM uvicorn stops accepting connections, running
        requests get `GRACE_S` to finish and then end with a 503 error (in the stream, if streamed);
        this returns and the command exits 0."""
        self.engine.start()
        if threading.current_thread() is threading.main_thread():
            # uvicorn re-raises the signal it caught once it has shut down: let that SIGTERM pass
            signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.engine.stop()

    def start(self) -> Server:
        """Serve from a background thread (tests, benchmarks); returns once it accepts connections."""
        self.engine.start()
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("server thread died during start-up")
            threading.Event().wait(0.02)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.engine.stop()
        self.sock.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def reload_on_sighup(selector: Selector) -> None:
    def reload_now() -> None:
        try:
            info = selector.reload()
            print(f"reloaded: version {info.get('version')}", file=sys.stderr, flush=True)
        except CartridgeError as exc:
            print(f"reload failed, still serving the previous version: {exc}", file=sys.stderr, flush=True)
        except Exception:
            traceback.print_exc()

    # Loading files takes a while: do it off the signal handler, in a thread of its own.
    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=reload_now, daemon=True).start())


def run(args: argparse.Namespace) -> int:
    import torch

    config = serve_config(args)
    for path in args.cartridge or ():  # before the model loads: a typo should fail fast
        if not Path(path).is_file():
            raise CartridgeFileError(f"{path}: no such cartridge file")
    if args.fleet:
        from cartridges.fleet.manifest import read_manifest, resolve

        if not Path(args.fleet).is_dir():
            raise FleetError(f"{args.fleet}: no such fleet directory")
        # a missing or damaged manifest (of the live version, for a published root) is a one-line
        # error before the model loads
        read_manifest(resolve(args.fleet))
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, args.device, args.dtype)
    selector: Selector
    if args.fleet:
        from server.fleet_selector import FleetSelector

        selector = FleetSelector(lm, args.fleet, rag_docs=args.rag_docs, adaptive=args.rag_adaptive,
                                 margin=0.05 if args.rag_margin is None else args.rag_margin,
                                 max_conversations=args.max_conversations,
                                 max_conversation_rows=args.max_conversation_rows, name=config.name)
        info = selector.describe()
        what = (f"fleet of {len(info['documents'])} documents, {info['rag_docs']} per conversation"
                + (f", adaptive (margin {info['rag_margin']})" if info["rag_adaptive"] else ""))
    else:
        selector = CartridgeSelector(lm, args.cartridge, config.name)
        what = f"{selector.describe()['prefix_rows']} cartridge rows"
    server = Server(lm, selector, config)
    reload_on_sighup(selector)
    auth = "API key required" if config.api_key else "no API key"
    print(f"serving '{selector.model_id}' ({what} on {lm.name}, {lm.device}, {lm.dtype_record()['dtype']}: "
          f"{lm.dtype_reason}) at {server.url}/v1 "
          f"({auth}; max batch {config.max_batch}); SIGHUP or POST /admin/reload reloads the "
          f"{'fleet' if args.fleet else 'cartridges'}", flush=True)
    server.run()
    return 0
