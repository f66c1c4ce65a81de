#!/usr/bin/env bash
# The device check a session runs when it is lent one GPU (the workplace's `device` tool):
# CUDA tests, the planner's GEMM curve against the device, tessera's step executor against a
# plain PyTorch loop (NCCL, one rank), and one `tessera train` run whose summary prints the
# planner's predicted step time beside the measured one. Each part's output goes to
# $OUT/<part>.txt (default ./gpu_out). Sized for a few minutes on an H100/H200.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$OUT/env.txt" 2>&1
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_gpu_readiness.py \
  "tests/test_context_parallel.py::test_ring_blocks_in_one_process" > "$OUT/tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.txt"
timeout 120 $PY benchmarks/gemm_curve.py > "$OUT/gemm_curve.txt" 2>&1
echo "rc=$?" >> "$OUT/gemm_curve.txt"
timeout 150 $PY benchmarks/bench_gpu_step.py --pairs 5 --steps 10 --profile 3 > "$OUT/gpu_step.txt" 2>&1
echo "rc=$?" >> "$OUT/gpu_step.txt"
# bench_gpu_step's model through the CLI, 40 steps: the summary's planner line
OUT=$OUT bash benchmarks/gpu_variants.sh bf16
