#!/usr/bin/env bash
# The device check a session runs when it is lent one GPU (the workplace's `device` tool), sized
# for ~8 minutes on an H200. Each part's output goes to $OUT/<part>.txt (default ./gpu_out):
#   env.txt       the GPU, driver, torch
#   tests.txt     CUDA tests (tests/test_gpu_readiness.py, the CUDA ring-attention blocks)
#   gpu_1b.txt    benchmarks/bench_gpu_1b.py: the llama-1b preset at sequence 2048, bf16, the
#                 largest micro-batch that fits: tessera eager, compiled, compiled + chunked
#                 cross-entropy, and the peer (torch.compile(model), fused AdamW, autocast);
#                 step, tokens/s, MFU (causal and full), HFU, peak memory; float8 loss curves
#                 where torchao imports; the planner's predicted steps for the 1B and the demo
#                 model with this GPU's launch cost and compiled rate
#   train_demo.txt  `tessera train --preset demo` (30 steps): the demo model's measured step
#                 beside the planner's (the summary line)
# FULL=1 also runs the older checks: the GEMM curve, bench_gpu_step.py and gpu_variants.sh.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  $PY -c 'import torchao; print("torchao", torchao.__version__)' 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_gpu_readiness.py \
  "tests/test_context_parallel.py::test_ring_blocks_in_one_process" > "$OUT/tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.txt"
timeout 420 $PY benchmarks/bench_gpu_1b.py --steps 10 --warmup 3 --chunk 1024 \
  > "$OUT/gpu_1b.txt" 2>&1
echo "rc=$?" >> "$OUT/gpu_1b.txt"
$PY -m tessera data prepare --source stdlib --out data/stdlib --if-missing > /dev/null 2>&1
timeout 90 $PY -m tessera train --preset demo --nproc 1 --dp 1 --precision bf16 --steps 30 \
  --set train.eval_interval=0 --set train.log_interval=10 --set train.sample_tokens=0 \
  --no-progress --out "$OUT/run_demo" > "$OUT/train_demo.txt" 2>&1
echo "rc=$?" >> "$OUT/train_demo.txt"
rm -rf "$OUT/run_demo"
if [ "${FULL:-0}" = 1 ]; then
  timeout 120 $PY benchmarks/gemm_curve.py > "$OUT/gemm_curve.txt" 2>&1
  echo "rc=$?" >> "$OUT/gemm_curve.txt"
  timeout 150 $PY benchmarks/bench_gpu_step.py --pairs 5 --steps 10 --profile 3 \
    > "$OUT/gpu_step.txt" 2>&1
  echo "rc=$?" >> "$OUT/gpu_step.txt"
  OUT=$OUT bash benchmarks/gpu_variants.sh bf16
fi
