"""The decode loop: one background thread owns the model and runs one batch for all requests.

Each turn of the loop: take new requests (select their prefix, render and check the
prompt; errors go straight back), drop requests whose client went away, admit waiting
requests into free slots (prefilled together per shared prefix), then one `choose` and
one `advance` of the running batch, so every running request gets one token per forward.
At most `max_batch` requests are resident; up to `max_queue` more wait for a slot.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cartridges.core.batch import Batch, Running, Stream
from cartridges.core.chat import end_of_turn_ids
from cartridges.core.models import LoadedModel
from cartridges.core.prefix import prefix_length
from server.errors import ApiError, bad_request, internal, overloaded
from server.options import ServeConfig
from server.schema import ChatParams
from server.selector import Selection, Selector

Sink = Callable[[str, object], None]  # (kind, data): "accepted", "token", "done", "error"


@dataclass
class Accepted:
    """What a request was accepted with: sent before its first token."""

    prompt_tokens: int  # including cached conversation tokens
    cached_tokens: int
    cartridge_rows: int
    names: tuple[str, ...]
    version: int
    max_tokens: int
    fleet_version: str | None = None


@dataclass
class Job:
    params: ChatParams
    sink: Sink
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: float = field(default_factory=time.time)
    cancelled: threading.Event = field(default_factory=threading.Event)
    selection: Selection | None = None
    stream: Stream | None = None

    def post(self, kind: str, data: object = None) -> None:
        try:
            self.sink(kind, data)
        except RuntimeError:  # the client's event loop is gone (server shutting down)
            self.cancelled.set()


class Engine:
    def __init__(self, lm: LoadedModel, selector: Selector, config: ServeConfig) -> None:
        self.lm = lm
        self.selector = selector
        self.config = config
        self.batch = Batch(lm.model)
        self.eot = tuple(end_of_turn_ids(lm.tokenizer))
        self.inbox: queue.Queue[Job | None] = queue.Queue()
        self.waiting: deque[Job] = deque()
        self.served = 0
        self.steps = 0
        self.drafted = 0  # draft tokens verified (serve --spec) in finished requests
        self.accepted = 0
        self.peak_active = 0
        self.failures = 0
        self._stop = threading.Event()
        self._ending: ApiError | None = None
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)

    # --- called from request handlers -------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

    def submit(self, params: ChatParams, sink: Sink) -> Job:
        queued = self.inbox.qsize() + len(self.waiting)
        if queued >= self.config.max_queue:
            raise overloaded(queued)
        job = Job(params, sink)
        self.inbox.put(job)
        return job

    def cancel(self, job: Job) -> None:
        """The client is gone or has what it needs: free the slot on the next turn."""
        if not job.cancelled.is_set():
            job.cancelled.set()
            self.inbox.put(None)  # wake the loop if it sleeps

    def end_all(self, error: ApiError) -> None:
        """Shutting down: every running and waiting request ends now with `error` (in its stream, for
        a streamed one), and so does any that still arrives."""
        self._ending = error
        self.inbox.put(None)

    def stats(self) -> dict:
        return {"active": len(self.batch), "waiting": len(self.waiting) + self.inbox.qsize(),
                "max_batch": self.config.max_batch, "max_queue": self.config.max_queue,
                "served": self.served, "decode_steps": self.steps, "peak_active": self.peak_active,
                "failures": self.failures, "alive": self._thread.is_alive(),
                "draft_tokens": self.drafted, "accepted_draft_tokens": self.accepted}

    # --- the decode thread ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._take(block=not len(self.batch) and not self.waiting)
                if self._ending is not None:
                    self._end_everything(self._ending)
                self._drop_cancelled()
                self._admit()
                if len(self.batch):
                    self._step()
            except Exception as exc:  # a failed forward must not kill the server
                self.failures += 1
                traceback.print_exc()
                for st in self.batch.states:
                    st.tag.post("error", internal(str(exc)))
                self.batch = Batch(self.lm.model)

    def _end_everything(self, error: ApiError) -> None:
        for job in [*self.waiting, *(st.tag for st in self.batch.states)]:
            job.post("error", error)
        self.waiting.clear()
        self.batch = Batch(self.lm.model)

    def _take(self, block: bool) -> None:
        try:
            job = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if job is not None and not job.cancelled.is_set():
                self._accept(job)
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(self, job: Job) -> None:
        params = job.params
        try:
            sel = self.selector.select(params.messages)
        except ApiError as err:
            job.post("error", err)
            return
        except Exception as exc:  # the chat template refused these messages
            job.post("error", bad_request(f"cannot render the messages with the model's chat template ({exc})",
                                          param="messages"))
            return
        p, n, context = prefix_length(sel.rows), len(sel.prompt), self.lm.context_length
        room = context - p - n
        if room < 1:
            job.post("error", bad_request(
                f"the prompt is {n} tokens behind {p} prefix rows; the model's context is {context} tokens",
                param="messages", code="context_length_exceeded"))
            return
        if params.max_tokens is not None and params.max_tokens > room:
            job.post("error", bad_request(
                f"max_tokens={params.max_tokens} does not fit: {p} prefix rows + {n} prompt tokens leave "
                f"{room} of the model's {context}-token context", param="max_tokens", code="context_length_exceeded"))
            return
        default = min(self.config.default_max_tokens, self.config.max_tokens_cap, room)
        max_new = params.max_tokens if params.max_tokens is not None else default
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        job.selection = sel
        job.stream = Stream(sel.prompt, max_new, temperature=params.temperature, top_p=params.top_p,
                            seed=seed % (1 << 63), stop_ids=self.eot, draft=self.config.spec,
                            draft_reference=sel.draft_reference)
        self.waiting.append(job)
        job.post("accepted", Accepted(sel.cached_tokens + n, sel.cached_tokens, sel.cartridge_rows, sel.names,
                                      sel.version, max_new, sel.fleet_version))

    def _drop_cancelled(self) -> None:
        if any(job.cancelled.is_set() for job in self.waiting):
            self.waiting = deque(job for job in self.waiting if not job.cancelled.is_set())
        gone = [st.tag for st in self.batch.states if st.tag.cancelled.is_set()]
        if gone:
            self.batch.drop(gone)

    def _admit(self) -> None:
        free = self.config.max_batch - len(self.batch)
        jobs: list[Job] = []
        while self.waiting and len(jobs) < free:
            job = self.waiting.popleft()
            if not job.cancelled.is_set():
                jobs.append(job)
        groups: dict[int, list[Job]] = {}
        for job in jobs:  # one prefill per shared prefix
            assert job.selection is not None
            groups.setdefault(id(job.selection.rows), []).append(job)
        for members in groups.values():
            sel = members[0].selection
            assert sel is not None
            try:
                self.batch.join([j.stream for j in members], sel.rows, tags=members,
                                keep_kv=any(j.selection.on_finish for j in members))
            except Exception as exc:
                traceback.print_exc()
                for job in members:
                    job.post("error", internal(f"prefill failed ({exc})"))

    def _step(self) -> None:
        stepped = self.batch.choose()
        self.steps += 1
        self.peak_active = max(self.peak_active, len(stepped))
        for st in stepped:
            job: Job = st.tag
            for token in st.tokens[len(st.tokens) - st.new :]:
                job.post("token", token)
            if st.finished:
                self._finish(job, st)
        if len(self.batch):
            self.batch.advance()

    def _finish(self, job: Job, st: Running) -> None:
        self.served += 1
        self.drafted += st.drafted
        self.accepted += st.accepted
        reason = "stop" if st.finished == "stop" else "length"
        job.post("done", {"finish_reason": reason, "completion_tokens": len(st.tokens)})
        sel = job.selection
        if sel is not None and sel.on_finish is not None and st.kv is not None:
            try:
                sel.on_finish(st.kv, st.tokens)
            except Exception:
                traceback.print_exc()
