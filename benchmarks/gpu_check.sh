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
# bench_gpu_step's model through the CLI: 40 steps, the summary's planner line
$PY -m tessera data prepare --source stdlib --out data/stdlib --if-missing > "$OUT/train.txt" 2>&1
timeout 180 $PY -m tessera train --preset demo --nproc 1 --dp 1 --steps 40 --precision bf16 \
  --micro-batch-size 16 --set model.d_model=1024 --set model.n_layers=12 \
  --set model.n_heads=16 --set model.n_kv_heads=4 --set model.max_seq_len=1024 \
  --set data.seq_len=1024 --set train.eval_interval=0 --set train.log_interval=10 \
  --set train.sample_tokens=0 --set train.warmup_steps=5 --no-progress \
  --out "$OUT/train_run" >> "$OUT/train.txt" 2>&1
echo "rc=$?" >> "$OUT/train.txt"
rm -rf "$OUT/train_run"
