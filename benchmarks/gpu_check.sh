#!/usr/bin/env bash
# The device check: what runs on a lent machine with one CUDA GPU, in well under 8 minutes.
#
#   benchmarks/gpu_check.sh [OUT_DIR]          # default results/gpu; needs a CUDA GPU
#   GPU_CHECK_DEVICE=cpu benchmarks/gpu_check.sh /tmp/gpu-check   # its CPU rehearsal, here
#
# 1. the unit tests that touch devices (tests/flexdemo/test_devices.py), with CUDA visible;
# 2. every method for 12 steps on 1 node x 1 GPU with nccl, through `flexbench profile-compute`
#    (a real `flexbench run --backend nccl` underneath), whose per-phase compute is written as
#    profile-lm-tiny-METHOD.json; then the same on lm-small (docs/workloads.md: the GPU-size model);
# 3. 2 ranks over gloo with CUDA tensors (both on the one GPU): which collectives gloo takes
#    (benchmarks/gloo_device_probe.py -> gloo_cuda.json). One GPU cannot run multi-rank nccl.
# Every step's outcome is a line of OUT_DIR/checks.csv (name, status, seconds); the full output
# is OUT_DIR/gpu_check.log. A failing step does not stop the others: the file says which failed.
#
# The lent machine has torch but not simpy (netsim's model needs it) and no registry: carry
# simpy as a wheel in .whl/ (git-ignored), made on a machine with a registry with
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl simpy==4.1.2
# and name `.whl` in the device call's carry; this script installs it to /tmp/site.
set -u
out_dir=${1:-results/gpu}
device=${GPU_CHECK_DEVICE:-cuda}
py=${PYTHON:-python3}
mkdir -p "$out_dir"
log="$out_dir/gpu_check.log"
checks="$out_dir/checks.csv"
: >"$log"
echo "check,status,seconds" >"$checks"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TQDM_DISABLE=1 PYTHONUNBUFFERED=1

if ! "$py" -c "import simpy" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl >>"$log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# check NAME SECONDS COMMAND...: run it with a time limit, log it, add its row to checks.csv.
check() {
    local name=$1 limit=$2 start status
    shift 2
    start=$(date +%s)
    echo "== $name: $*" >>"$log"
    if timeout "$limit" "$@" >>"$log" 2>&1; then status=pass; else status="fail (exit $?)"; fi
    echo "$name,$status,$(($(date +%s) - start))" | tee -a "$checks"
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count())"
} >"$out_dir/environment.txt" 2>&1

if [ "$device" = cuda ]; then
    backend=nccl
    shape=(--nodes 1 --gpus-per-node 1)
    workloads=(lm-tiny lm-small)
else
    backend=gloo
    shape=(--nodes 2 --gpus-per-node 1)  # the rehearsal: encode and decode run at 2 nodes
    workloads=(lm-tiny)
fi

check device-tests 120 "$py" -m pytest -q -p no:cacheprovider tests/flexdemo/test_devices.py
methods=$("$py" -c "from flexdemo.methods import METHODS; print(' '.join(METHODS))")
for workload in "${workloads[@]}"; do
    for method in $methods; do
        check "profile-$workload-$method" 90 "$py" -m experiments.cli profile-compute \
            --workload "$workload" --method "$method" "${shape[@]}" --backend "$backend" \
            --steps 12 --warmup 4 --out "$out_dir/profile-$workload-$method.json"
    done
done
check "gloo-$device-collectives" 90 "$py" benchmarks/gloo_device_probe.py --device "$device" \
    --out "$out_dir/gloo_$device.json"
echo "checks: $checks ($(grep -c ',pass,' "$checks") passed, $(grep -c ',fail' "$checks") failed)"
