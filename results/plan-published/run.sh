#!/usr/bin/env bash
# Plans the inputs of Table 4 of "Streaming DiLoCo with overlapping communication: Towards a
# Distributed Free Lunch" (arXiv 2501.18512): three model sizes x five methods, two workers,
# 0.1-1000 Gbit/s in 50 log-spaced points. Writes one CSV and one text report per run here;
# compare.py prints their figures beside ours. The outer syncs start in the backward
# (sync_in_backward=true), as the paper's simulator schedules them, and a fragment is 3 runs
# strided over the depth (fragment_runs=3), as the paper's fragments are 3 strided layers; the
# *-after-step runs post the syncs after the optimizer step, as flexdemo's replicator does, and
# streaming-contiguous cuts each fragment as one run. The two *-1gbit plans of the 1B model are
# Table 1's question (hours at 1 Gbit/s). Run from the repository root (OUT=DIR writes
# elsewhere):
#   bash results/plan-published/run.sh
set -euo pipefail
OUT=${OUT:-results/plan-published}
mkdir -p "$OUT"
PY=${PYTHON:-python}
# size: model spec, step time (the paper's), fragments (3 layers each), a fragment cycle
# (the first multiple of the fragment count from H=100 up).
declare -A MODEL=(
  [1b]="gpt:dim=2048,layers=24,heads=16,vocab=32768,ffn=3584,tied=true"
  [10b]="gpt:dim=4096,layers=48,heads=32,vocab=32768,ffn=11264,tied=true"
  [100b]="gpt:dim=8192,layers=108,heads=64,kv_heads=8,vocab=32768,ffn=31744,tied=true"
)
declare -A STEP=([1b]=0.1 [10b]=0.8 [100b]=4.9)
declare -A FRAGMENTS=([1b]=8 [10b]=16 [100b]=36)
declare -A CYCLE=([1b]=104 [10b]=112 [100b]=108)
for size in 1b 10b 100b; do
  common=(--model "${MODEL[$size]}" --nodes 2 --gpus-per-node 1 --step-compute "${STEP[$size]}"
          --inter-lat 0ms)
  contiguous=(--method streaming-diloco --set num_fragments="${FRAGMENTS[$size]}"
              --set sync_every="${CYCLE[$size]}" --set fragment_cut=elements)
  streaming=("${contiguous[@]}" --set fragment_runs=3)
  diloco=(--method streaming-diloco --set num_fragments=1 --set sync_every=100
          --set fragment_sync_delay=0 --set outer_format=bf16)
  early=(--set sync_in_backward=true)
  run() {  # name, then the plan's own arguments; BW=RATES plans other bandwidths than the grid
    local name=$1; shift
    $PY -m experiments.cli plan "${common[@]}" --inter-bw "${BW:-0.1Gbit:1Tbit:50}" "$@" \
      --out "$OUT/$size-$name.csv" \
      > "$OUT/$size-$name.txt"
  }
  run data-parallel --method hsdp-adamw --set reduce_dtype=bf16
  run diloco "${diloco[@]}" "${early[@]}"
  run diloco-after-step "${diloco[@]}"
  run streaming "${streaming[@]}" --set fragment_sync_delay=0 --set outer_format=bf16 "${early[@]}"
  run streaming-after-step "${streaming[@]}" --set fragment_sync_delay=0 --set outer_format=bf16
  run streaming-contiguous "${contiguous[@]}" --set fragment_sync_delay=0 --set outer_format=bf16 \
    "${early[@]}"
  run streaming-overlap "${streaming[@]}" --set fragment_sync_delay=1 --set outer_format=bf16 \
    "${early[@]}"
  run streaming-overlap-fp4 "${streaming[@]}" --set fragment_sync_delay=1 --set outer_format=4bit \
    "${early[@]}"
  if [[ $size == 1b ]]; then
    BW=1Gbit run data-parallel-1gbit --method hsdp-adamw --set reduce_dtype=bf16
    BW=1Gbit run streaming-overlap-fp4-1gbit "${streaming[@]}" --set fragment_sync_delay=1 \
      --set outer_format=4bit "${early[@]}"
  fi
done
