#!/usr/bin/env bash
# DBench's graphs at scale, emulated: gossip on ring, torus, exponential, one-peer-exponential,
# sites:4 and complete, and Ada, seeds 0-2, on vision-tiny at 16, 64 and 256 nodes and lm-tiny
# at 16 and 64 nodes of one rank. A unit already written is kept; the order is the cheapest first.
set -euo pipefail
cd "$(dirname "$0")"
GRAPHS=(ring torus exponential one-peer-exponential sites:4 complete)
unit() {  # workload nodes seed method [graph]
  local workload=$1 nodes=$2 seed=$3 method=$4 graph=${5:-}
  local name="${method}-${workload}-nodes=${nodes}"
  [[ -n "$graph" ]] && name="${name}_graph=${graph/:/_}"
  local out="units/${name}-s${seed}"
  [[ -f "$out/run.json" ]] && return 0
  rm -rf "$out"
  local steps=200
  [[ "$workload" == lm-tiny ]] && steps=100
  flexbench run --emulate --method "$method" ${graph:+--graph "$graph"} --nodes "$nodes" \
    --workload "$workload" --steps "$steps" --eval-every 10 --seed "$seed" --out "$out"
}
for shape in vision-tiny:16 vision-tiny:64 lm-tiny:16 vision-tiny:256 lm-tiny:64; do
  workload=${shape%:*} nodes=${shape#*:}
  for seed in 0 1 2; do
    for graph in "${GRAPHS[@]}"; do
      unit "$workload" "$nodes" "$seed" gossip "$graph"
    done
    unit "$workload" "$nodes" "$seed" ada
  done
done
