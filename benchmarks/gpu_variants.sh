#!/usr/bin/env bash
# bench_gpu_step.py's model (d 1024, 12 layers, seq 1024, micro-batch 16) through `tessera
# train` on one GPU; each summary prints the planner's predicted step beside the measured one.
# Variants (all by default, or those named): bf16 (40 steps; gpu_check.sh runs it), zero3_full
# (bf16 + ZeRO-3 + full recomputation) and fp32, 30 steps each. Output: $OUT/train_<name>.txt.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
$PY -m tessera data prepare --source stdlib --out data/stdlib --if-missing > /dev/null 2>&1
run() {  # name, steps, extra flags...
  local name=$1 steps=$2; shift 2
  timeout 180 $PY -m tessera train --preset demo --nproc 1 --dp 1 --steps "$steps" \
    --micro-batch-size 16 --set model.d_model=1024 --set model.n_layers=12 \
    --set model.n_heads=16 --set model.n_kv_heads=4 --set model.max_seq_len=1024 \
    --set data.seq_len=1024 --set train.eval_interval=0 --set train.log_interval=10 \
    --set train.sample_tokens=0 --set train.warmup_steps=5 --no-progress \
    --out "$OUT/run_$name" "$@" > "$OUT/train_$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/train_$name.txt"
  rm -rf "$OUT/run_$name"
}
wanted=${*:-bf16 zero3_full fp32}
for name in $wanted; do
  case $name in
    bf16) run bf16 40 --precision bf16 ;;
    zero3_full) run zero3_full 30 --precision bf16 --zero-stage 3 --recompute full ;;
    fp32) run fp32 30 --precision fp32 ;;
    *) echo "unknown variant $name (bf16, zero3_full, fp32)" >&2; exit 2 ;;
  esac
done
