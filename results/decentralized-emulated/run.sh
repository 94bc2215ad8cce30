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
# At 256 nodes the complete graph (and Ada, which starts on it) holds 256 x 255 receive buffers
# of vision-tiny's parameters, about 45 GiB: the emulator refuses them on a 24 GB machine.
fits() { [[ "$MEMORY_GIB" -ge 48 || "$1" -lt 256 ]]; }
MEMORY_GIB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1048576 ))
for shape in vision-tiny:16 vision-tiny:64 lm-tiny:16 vision-tiny:256 lm-tiny:64; do
  workload=${shape%:*} nodes=${shape#*:}
  for seed in 0 1 2; do
    for graph in "${GRAPHS[@]}"; do
      if [[ "$graph" != complete ]] || fits "$nodes"; then
        unit "$workload" "$nodes" "$seed" gossip "$graph"
      fi
    done
    if fits "$nodes"; then unit "$workload" "$nodes" "$seed" ada; fi
  done
done
