"""The fleet job: documents -> per-document cartridges -> rounds -> index -> published manifest.

`fleet_run` holds the run's record around the steps (`STEPS`); the Prefect flow `fleet`
runs each step's pieces as tasks through `call`, `run_fleet` with plain calls.

A fleet directory is created by a first run; later runs need `resume=True` and then
(1) drop documents no longer given, (2) re-initialize documents whose content
changed and initialize new ones, and (3) train: when some documents are new or
changed, only those train (the others' files stay byte-identical); otherwise the
whole fleet continues from its saved rows, moments, step counters and residents.
`rounds=0` trains nothing, so a resume with it rebuilds only the retrieval index.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from cartridges.core.corpus import check_inside
from cartridges.core.errors import CorpusError, FleetError
from cartridges.core.health import training_health
from cartridges.core.models import LoadedModel
from cartridges.fleet.budget import initial_residents
from cartridges.fleet.index import build_index, contract
from cartridges.fleet.manifest import (
    MANIFEST,
    DocEntry,
    Manifest,
    check_model,
    prune,
    read_manifest,
    write_manifest,
)
from cartridges.fleet.residents import new_resident, save_resident
from cartridges.selfstudy.spans import keyed_seed
from jobs import Call, plain
from jobs.report import write_run_report
from schemas import TABLES, FleetConfig, IngestConfig, validate_table
from stages import fleet_data, ingest
from stages.fanout import Fanout
from stages.fleet_train import FleetTrainer
from stages.job import Job
from stages.progress import progress
from storage import Store, shards
from storage.errors import StoreError
from storage.faults import fault_point
from storage.lock import LOCK_FILE, exclusive
from storage.versions import is_versioned

NAME = "fleet"
VERSION = 1
# Each round's train_steps row, written as the round finishes (one shard per round, replaced
# whole when a resumed run replays the round), recorded in the catalog and cleared at the end
# of a run: rows of rounds a crashed run kept in a checkpoint are not lost.
JOURNAL = ".train_steps"


def fleet_files(paths: list[str | Path], config: IngestConfig = IngestConfig()) -> list[Path]:
    """Each file given, and each top-level .md/.txt file of each directory given, in order."""
    if not paths:
        raise CorpusError("no documents given (--docs FILE_OR_DIR ...)")
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in config.extensions)
            if not found:
                raise CorpusError(f"{path}: directory has no top-level {'/'.join(config.extensions)} files")
            out += [check_inside(p, path) for p in found]
        elif path.exists():
            out.append(path)
        else:
            raise CorpusError(f"{path}: no such file or directory")
    return out


def check_target(directory: str | Path, resume: bool) -> None:
    """A new fleet needs a new or empty directory; `resume` needs an existing fleet."""
    directory = Path(directory)
    if is_versioned(directory):
        raise FleetError(f"{directory}: is a published fleet root (versions/ and current); "
                         "update it with the retrain flow (cartridges retrain)")
    if (directory / MANIFEST).exists():
        if not resume:
            raise FleetError(f"{directory}: already holds a fleet; pass --resume to continue or update it")
    elif resume:
        raise FleetError(f"{directory}: no fleet to resume (no {MANIFEST})")
    elif directory.exists() and (not directory.is_dir() or not _leftovers_only(directory)):
        raise FleetError(f"{directory}: exists and is not an empty directory; choose a new --fleet directory")


def _initialize(lm: LoadedModel, job: dict) -> DocEntry:
    entry = DocEntry(**job["entry"])
    try:
        res = new_resident(lm, entry, job["text"], job["p"], job["frozen"], job["lr"])
    except CorpusError as exc:
        raise CorpusError(f"{job['path']}: {exc}") from exc
    saved = save_resident(Path(job["directory"]), lm, entry, res)
    fault_point(f"fleet.prepare.{entry.doc_id}")
    return saved


def init_document(job: dict) -> dict:
    """One document's corpus-init cartridge, computed and written by a worker; returns its entry."""
    from stages.fanout import worker_model

    return asdict(_initialize(worker_model(job["model"]), job))


def _leftovers_only(directory: Path) -> bool:
    """Empty, or holding only files a first run left when it died before writing its manifest."""
    for path in directory.iterdir():
        name = path.name
        leftover = path.is_file() and (name.startswith(("doc-", "index")) or
                                       (name.startswith(".") and name.endswith(".tmp")))
        if not leftover and not (name == JOURNAL and path.is_dir()) and name != LOCK_FILE:
            return False
    return True


def prepare(lm: LoadedModel, documents: list[dict], directory: Path, config: FleetConfig, resume: bool,
            log: Callable[[str], None] = print, fanout: Fanout | None = None) -> dict:
    """Create or reconcile the fleet directory; new and changed documents get corpus-init cartridges
    (on `fanout`'s workers when given: the fleet directory must then be on a shared filesystem).

    Returns {"manifest", "initialized" (doc ids), "removed" (names), "trainable", "residents"}.
    """
    directory = Path(directory)
    for doc in documents:
        if doc["tokens"] < config.chunk_min:
            raise CorpusError(f"{doc['path']}: {doc['tokens']} tokens, a fleet document needs at least "
                              f"chunk_min={config.chunk_min}")
    check_target(directory, resume)
    if (directory / MANIFEST).exists():
        manifest = read_manifest(directory)
        check_model(manifest, lm.fingerprint, directory)
        if (manifest.p, manifest.frozen) != (config.p, config.frozen):
            raise FleetError(f"{directory}: fleet has p={manifest.p}, frozen={manifest.frozen}; "
                             f"this run asks for p={config.p}, frozen={config.frozen}")
    else:
        manifest = Manifest(model=lm.fingerprint, p=config.p, frozen=config.frozen, seed=config.seed,
                            embedding=contract(config.embed_chunk))
    directory.mkdir(parents=True, exist_ok=True)
    given = {d["name"]: d for d in documents}
    old = manifest.by_name()
    removed = sorted(set(old) - set(given))
    next_id = max([d.doc_id for d in manifest.documents], default=-1) + 1
    entries, initialized, jobs = [], [], []
    for doc in documents:
        entry = old.get(doc["name"])
        if entry is not None and entry.sha256 == doc["sha256"]:
            entries.append(entry)
            continue
        if entry is not None:
            doc_id = entry.doc_id
        else:
            doc_id, next_id = next_id, next_id + 1
        fresh = DocEntry(doc_id, doc["name"], doc["sha256"], doc["tokens"])
        job = {"directory": str(directory), "entry": asdict(fresh), "text": doc["text"], "path": doc["path"],
               "p": config.p, "frozen": config.frozen, "lr": config.lr}
        if fanout is None:
            fresh = _initialize(lm, job)
        else:
            jobs.append({**job, "model": fanout.model})
        entries.append(fresh)
        initialized.append(doc_id)
        log(f"{'re-initialized' if entry is not None else 'initialized'} {doc['name']} (doc {doc_id})")
    if jobs:
        done = {d["doc_id"]: DocEntry(**d) for d in fanout.map(init_document, jobs)}
        entries = [done.get(e.doc_id, e) for e in entries]
    manifest.documents = sorted(entries, key=lambda e: e.doc_id)
    manifest.config = config.to_dict()
    trained_before = [e.doc_id for e in entries if e.doc_id not in initialized]
    incremental = bool(initialized) and bool(trained_before)
    trainable = sorted(initialized) if incremental else sorted(e.doc_id for e in entries)
    kept = [r for r in manifest.residents if r in set(trainable)]
    if incremental or removed or len(kept) != min(config.budget, len(trainable)):
        residents = initial_residents({d: manifest.by_id()[d].steps for d in trainable}, config.budget)
    else:
        residents = kept
    manifest.residents = residents
    write_manifest(directory, manifest)
    prune(directory, manifest)
    return {"manifest": manifest, "initialized": initialized, "removed": removed,
            "trainable": trainable, "residents": residents}


def eval_parts(doc_id: int, others: list[int], n: int, seed: int) -> tuple[list[int], int]:
    """`n` distractors for a document and the target's position among them (keyed, reproducible)."""
    rng = random.Random(keyed_seed(seed, "eval", doc_id))
    chosen = rng.sample(sorted(others), min(n, len(others)))
    return chosen, rng.randint(0, len(chosen))


# The fleet job's steps, in order; `FleetRun.step(name, call)` runs one.
STEPS = ("ingest", "prepare", "heldout", "rounds", "evaluate", "record", "index", "publish")


class FleetRun:
    """One run of the fleet job over a fleet directory: each step does one job and keeps what
    the later steps need."""

    def __init__(self, job: Job, directory: Path, config: FleetConfig, resume: bool,
                 log: Callable[[str], None], eval_distractors: int) -> None:
        self.job, self.directory, self.config, self.resume = job, directory, config, resume
        self.log, self.eval_distractors = log, eval_distractors
        self.summary: dict = {}

    def step(self, name: str, call: Call = plain) -> None:
        getattr(self, name)(call)

    def ingest(self, call: Call) -> None:
        art = call(ingest.run, self.job, self.config.ingest)
        self.documents = self.job.store.table(art).to_pylist()

    def prepare(self, call: Call) -> None:
        """Create or reconcile the directory, then the documents every later step uses."""
        lm = self.job.model
        self.state = call(prepare, lm, self.documents, self.directory, self.config, self.resume, self.log,
                          self.job.fanout)
        self.manifest: Manifest = self.state["manifest"]
        by_name = {d["name"]: d for d in self.documents}
        token_ids = {d["name"]: list(lm.tokenizer(d["text"], add_special_tokens=False)["input_ids"])
                     for d in self.documents}
        self.docs_by_id = {e.doc_id: {"doc_id": e.doc_id, "name": e.name, "sha256": e.sha256,
                                      "token_ids": token_ids[e.name], "text": by_name[e.name]["text"]}
                           for e in self.manifest.documents}
        self.evaluated = self.config.rounds > 0 or bool(self.state["initialized"])
        self.trainer = FleetTrainer(self.directory, lm, self.manifest, self.config, self.state["trainable"],
                                    self.state["residents"])
        run_id = self.job.run_id
        self.trainer.journal = lambda row: journal_row(self.directory, {"run_id": run_id, **row})

    def heldout(self, call: Call) -> None:
        """Each trainable document's held-out set, and the loss before training where it is new."""
        self.heldout_sets: dict[int, list] = {}
        if self.evaluated and self.config.heldout:
            for doc_id in self.state["trainable"]:
                art = call(fleet_data.heldout_data, self.job.store, self.job.model, self.docs_by_id[doc_id],
                           self.config, self.job.model_id, self.job.run_id)
                self.heldout_sets[doc_id] = fleet_data.examples(self.job.store, art)
        for doc_id in self.state["trainable"]:
            entry = self.manifest.by_id()[doc_id]
            # new documents, and untrained ones whose first run died before a checkpoint kept the figure
            if doc_id in self.state["initialized"] or (entry.steps == 0 and entry.heldout_before is None
                                                       and self.evaluated):
                entry.heldout_before = self.trainer.heldout_loss(doc_id, self.heldout_sets.get(doc_id, []))

    def rounds(self, call: Call) -> None:
        """The training rounds (each one's data and its step), then a checkpoint."""
        self.rows: list[dict] = []
        first = self.manifest.rounds
        with progress(self.config.rounds, "fleet rounds", "round") as bar:
            for r in range(first, first + self.config.rounds):
                plan = self.trainer.plan(r)
                art = call(fleet_data.round_data, self.job.store, self.job.model, plan,
                           self.docs_by_id[plan.target], self.config, self.job.model_id, self.job.run_id)
                row = call(self.trainer.train, plan, fleet_data.examples(self.job.store, art))
                self.rows.append({"run_id": self.job.run_id, **row})
                detail = (f"loss {row['loss']:.4f}  lr {row['lr']:.2e}" if row["tokens"]
                          else "no usable conversations (all filtered): nothing trained")
                self.log(f"round {r:4d}  {row['visibility']:<12} {' + '.join(row['docs'])}  {detail}")
                bar.update(1)
        self.trainer.checkpoint()

    def evaluate(self, call: Call) -> None:
        """Per document: steps, held-out loss before and after (and co-loaded), health."""
        self.per_doc = [self._document_report(entry) for entry in self.manifest.documents]

    def _document_report(self, entry: DocEntry) -> dict:
        item = {"name": entry.name, "doc_id": entry.doc_id, "steps": entry.steps,
                "heldout_before": entry.heldout_before, "changed": entry.doc_id in self.state["initialized"],
                "trained": any(entry.name in r["docs"] for r in self.rows)}
        if self.evaluated and entry.doc_id in self.state["trainable"]:
            examples = self.heldout_sets.get(entry.doc_id, [])
            item["heldout_after"] = self.trainer.heldout_loss(entry.doc_id, examples)
            if self.eval_distractors:
                others = [d for d in self.trainer.entries if d != entry.doc_id]
                chosen, pos = eval_parts(entry.doc_id, others, self.eval_distractors, self.config.seed)
                item["heldout_coloaded"] = self.trainer.heldout_loss(entry.doc_id, examples, chosen, pos)
            if item["trained"]:
                item["health_reason"] = training_health([], item["heldout_before"], item["heldout_after"])
        return item

    def record(self, call: Call) -> None:
        """The journaled rounds into the catalog's `train_steps` table, then the journal goes."""
        recorded = journal_rows(self.directory, self.manifest.rounds, self.log)
        if recorded:
            call(record_steps, self.job.store, recorded, self.directory, self.config, self.job.run_id)
            fault_point("fleet.steps.recorded")
        shutil.rmtree(self.directory / JOURNAL, ignore_errors=True)

    def index(self, call: Call) -> None:
        self.manifest.index = call(index, self.job.model, list(self.docs_by_id.values()), self.directory,
                                   self.config)

    def publish(self, call: Call) -> None:
        """The new manifest, then the files it no longer names removed."""
        fault_point("fleet.publish.manifest")
        write_manifest(self.directory, self.manifest)
        fault_point("fleet.publish.prune")
        prune(self.directory, self.manifest)

    def finish(self, seconds: float) -> dict:
        rows = self.rows
        return {"kind": NAME, "run_id": self.job.run_id, "fleet": str(self.directory), "rounds_run": len(rows),
                "rounds": self.manifest.rounds,
                "residents": [self.trainer.entries[d].name for d in self.trainer.residents],
                "removed": self.state["removed"], "documents": self.per_doc, "losses": [r["loss"] for r in rows],
                "steps_table": rows, "index_chunks": self.manifest.index["n_chunks"],
                "seconds": seconds, **self.job.model.dtype_record()}


@contextmanager
def fleet_run(
    store: Store, lm: LoadedModel, docs: list[str | Path], directory: str | Path,
    config: FleetConfig = FleetConfig(), resume: bool = False, log: Callable[[str], None] = print,
    eval_distractors: int = 0, fanout: Fanout | None = None, lock_wait: float | None = 0.0,
) -> Iterator[FleetRun]:
    """The catalog run (and the directory's lock) around the steps made in the `with` body; on
    leaving it, the summary (in `.summary`) and report are written and the run is closed.

    One writer per fleet directory: another one holding it makes this wait up to `lock_wait`
    seconds, then raise `storage.lock.Busy` naming it (`None`: the caller holds the lock already).
    """
    with contextlib.ExitStack() as held:
        if lock_wait is not None:
            held.enter_context(exclusive(directory, NAME, lock_wait))
        directory = Path(directory)
        files = fleet_files(docs, config.ingest)
        run_id = store.catalog.start_run(NAME)
        started = time.perf_counter()
        with store.catalog.failing_run(run_id):
            run = FleetRun(Job(store, lm, tuple(files), run_id, fanout=fanout), directory, config, resume, log,
                           eval_distractors)
            yield run
            run.summary = run.finish(time.perf_counter() - started)
            write_run_report(store, run.summary)
            store.catalog.finish_run(run_id, "complete",
                                     {k: v for k, v in run.summary.items() if k != "steps_table"})


def run_fleet(
    store: Store, lm: LoadedModel, docs: list[str | Path], directory: str | Path,
    config: FleetConfig = FleetConfig(), resume: bool = False, call: Call = plain,
    log: Callable[[str], None] = print, eval_distractors: int = 0, fanout: Fanout | None = None,
    lock_wait: float | None = 0.0,
) -> dict:
    """Build, update or continue a fleet and its index; returns the run summary.

    With `fanout`, new and changed documents are initialized on its workers.
    """
    with fleet_run(store, lm, docs, directory, config, resume, log, eval_distractors, fanout, lock_wait) as run:
        for name in STEPS:
            run.step(name, call)
    return run.summary


def journal_row(directory: Path, row: dict) -> None:
    """Keep one round's row in the fleet directory until the run records it in the catalog."""
    table = validate_table("train_steps", pa.Table.from_pylist([row], schema=TABLES["train_steps"]))
    shards.write_shard(Path(directory) / JOURNAL, row["step"], table)


def journal_rows(directory: Path, rounds: int, log: Callable[[str], None] = print) -> list[dict]:
    """Journaled rows of rounds the fleet kept (step < `rounds`), by step; rows of rounds a crash
    lost (to be replayed) are left out, and an unreadable shard is reported and skipped."""
    rows = []
    for step, path in shards.done_shards(Path(directory) / JOURNAL).items():
        if step >= rounds:
            continue
        try:
            rows += shards.read_shard(path, TABLES["train_steps"]).to_pylist()
        except StoreError as exc:
            log(f"warning: train_steps row of round {step} lost: {exc}")
    return rows


def record_steps(store: Store, rows: list[dict], directory: Path, config: FleetConfig, run_id: str):
    """The journaled rounds (this run's, and those of crashed runs it continued) as the
    `train_steps` table: one shard per round."""
    def work(ctx) -> None:
        for row in rows:
            table = pa.Table.from_pylist([row], schema=TABLES["train_steps"])
            ctx.write_shard(row["step"], validate_table("train_steps", table), table="train_steps")
            fault_point("fleet.steps.shard")

    cfg = {"fleet": str(Path(directory).resolve()), "run_id": run_id, "config": config.to_dict()}
    return store.run(NAME, VERSION, cfg, [], work, run_id=run_id)


def index(lm: LoadedModel, documents: list[dict], directory: Path, config: FleetConfig) -> dict:
    """Build the retrieval index files; returns the manifest's index entry."""
    return build_index(lm.model, lm.tokenizer, documents, config.embed_chunk, directory)
