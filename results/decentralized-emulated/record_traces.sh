#!/usr/bin/env bash
# Real 16-node runs (16 gloo processes, one rank a node) of each graph and Ada, on vision-tiny and
# lm-tiny, 20 steps (Ada as many as its units run, 200 and 100, so that its graph's changes are
# in its trace): the traces analyze.py replays for step times. A trace already written is kept.
set -euo pipefail
cd "$(dirname "$0")"
for workload in vision-tiny lm-tiny; do
  ada_steps=200
  [[ "$workload" == lm-tiny ]] && ada_steps=100
  for arm in ring torus exponential one-peer-exponential sites:4 complete ada; do
    out="traces/${workload}/${arm/:/_}"
    [[ -f "$out/run.json" ]] && continue
    rm -rf "$out"
    if [[ "$arm" == ada ]]; then
      args=(--method ada --steps "$ada_steps")
    else
      args=(--method gossip --graph "$arm" --steps 20)
    fi
    flexbench run "${args[@]}" --nodes 16 --gpus-per-node 1 --workload "$workload" \
      --eval-every 10 --threads-per-rank 1 --seed 0 --out "$out"
  done
done
