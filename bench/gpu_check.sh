#!/usr/bin/env bash
# The GPU path in one prepared run (about 8 minutes on one accelerator): the equivalence gate
# in bfloat16 (1 and 2 parts), a small training run, the self-study throughput benchmark and
# the serving benchmark, all with --device cuda. Figures land in $OUT (default gpu-check/),
# one JSON file per step; the summary is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
step() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
  echo "   exit $rc; $(tail -n 1 "$OUT/$name.log" | cut -c1-300)"
}
"$BIN/python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 2
step equiv-1 90 "$BIN/cartridges" equiv --device cuda --corpus docs/corpus/deflate.md --p 256 --suffix-max 128 --json
step equiv-2 90 "$BIN/cartridges" equiv --device cuda --corpus docs/corpus/deflate.md --p 256 --suffix-max 128 --parts 2 --json
step train 150 "$BIN/cartridges" train --device cuda --preset smoke --corpus docs/eval/raft.md \
  --store "$OUT/store" --save "$OUT/raft.safetensors" --no-prefect --json
step pipeline 150 "$BIN/python" -m bench.bench_pipeline --device cuda --dtype bfloat16 --conversations 64 --json
step serve 60 "$BIN/python" -m bench.bench_serve --device cuda --json
echo "figures in $OUT/"
