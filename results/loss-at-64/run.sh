#!/usr/bin/env bash
# Emulated loss curves of flexdemo, demo, diloco and hsdp-adamw on vision-tiny at 4, 16 and 64
# nodes of one rank, seeds 0-2 (36 units); a unit already written is kept.
set -euo pipefail
cd "$(dirname "$0")"
for nodes in 4 16 64; do
  for method in hsdp-adamw flexdemo demo diloco; do
    for seed in 0 1 2; do
      out="units/${method}-nodes=${nodes}-s${seed}"
      [[ -f "$out/run.json" ]] && continue
      rm -rf "$out"
      flexbench run --emulate --method "$method" --nodes "$nodes" --workload vision-tiny \
        --steps 200 --eval-every 10 --seed "$seed" --out "$out"
    done
  done
done
