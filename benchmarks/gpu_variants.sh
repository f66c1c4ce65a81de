#!/usr/bin/env bash
# Beside gpu_check.sh, when device time is left: the same model through `tessera train` with
# ZeRO-3 + full recomputation (bf16) and in fp32, 30 steps each; each summary's planner line.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
$PY -m tessera data prepare --source stdlib --out data/stdlib --if-missing > /dev/null 2>&1
run() {  # name, extra flags...
  local name=$1; shift
  timeout 150 $PY -m tessera train --preset demo --nproc 1 --dp 1 --steps 30 \
    --micro-batch-size 16 --set model.d_model=1024 --set model.n_layers=12 \
    --set model.n_heads=16 --set model.n_kv_heads=4 --set model.max_seq_len=1024 \
    --set data.seq_len=1024 --set train.eval_interval=0 --set train.log_interval=10 \
    --set train.sample_tokens=0 --set train.warmup_steps=5 --no-progress \
    --out "$OUT/run_$name" "$@" > "$OUT/train_$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/train_$name.txt"
  rm -rf "$OUT/run_$name"
}
run zero3_full --precision bf16 --zero-stage 3 --recompute full
run fp32 --precision fp32
