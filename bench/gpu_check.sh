#!/usr/bin/env bash
# The GPU check in one command (bench/gpu_check.py, docs/BENCHMARKS.md): correctness on the device
# and throughput at real model shapes with random weights, under the machine's own python3 with
# this repository on PYTHONPATH; nothing to install. Writes gpu_check.json and gpu_check.log into
# $OUT (default gpu-check/). Arguments pass through: `bench/gpu_check.sh --device cpu --tiny` is
# the dry run; `make gpu-check-dry` runs that in a clean environment like the accelerator's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m bench.gpu_check --out "${OUT:-gpu-check}" "$@"
