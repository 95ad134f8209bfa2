#!/usr/bin/env bash
# bench/gpu: dnallm-train against the Hugging Face peer (hf_peer.py: BertForMaskedLM, SDPA,
# bf16 autocast, fused AdamW) on one GPU, in the shape of configs/dnabert-mlm.toml (hidden
# 768, 12 layers, 12 heads, FFN 3072, 6-mer vocabulary 4101, 512 tokens), dropout 0, bf16.
# Builds nothing: run scripts/build.sh --cuda first.
#
#   bench/gpu/bench_gpu.sh [--bin DIR] [--out DIR] [--micro "16 64"] [--steps N]
#                          [--warmup N] [--rounds N] [--peer-attn sdpa|eager]
#   env: PYTHON (python3), CUDA_VISIBLE_DEVICES (the GPU to use)
#
# For each micro-batch, ROUNDS rounds of: ours, then the peer (alternating, so drifting
# clocks or a neighbour's load hit both alike). Each run: WARMUP untimed steps, then STEPS
# timed ones. Prints one table: median tokens/s over the timed steps (micro x 512 / median
# step time), MFU (tokens/s x (6 N + 12 L H S) / device bf16 peak), peak GPU memory (the
# largest nvidia-smi reading of the process, sampled every 0.2 s: the same ruler for
# both; the self-reported peak allocation beside it where the program reports one), the
# loss after the last step, and ours / peer. Raw results stay in OUT (default: a temp dir).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=build-cuda/bin
OUT=""
MICRO="16 64"
STEPS=100
WARMUP=20
ROUNDS=1
PEER_ATTN=sdpa
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --micro) MICRO="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --peer-attn) PEER_ATTN="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "bench_gpu.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
[ -x "$BIN/dnallm-train" ] || { echo "bench_gpu.sh: no $BIN/dnallm-train (scripts/build.sh --cuda)" >&2; exit 2; }
"$PYTHON" -c 'import torch, transformers' 2>/dev/null ||
  { echo "bench_gpu.sh: $PYTHON cannot import torch and transformers (the peer needs both)" >&2; exit 2; }
if [ -z "$OUT" ]; then OUT=$(mktemp -d); fi
mkdir -p "$OUT"

# Runs "$@" with its output in $1.log, sampling its GPU memory (MiB, the process and its
# children) into $1.mem every 0.2 s.
run_sampled() {
  local name=$1; shift
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.log" &
  local pid=$! peak=0
  while kill -0 "$pid" 2>/dev/null; do
    if command -v nvidia-smi >/dev/null; then
      local pids used
      pids=" $pid $(pgrep -P "$pid" | tr '\n' ' ')"
      used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
             awk -F', *' -v p="$pids" 'index(p, " " $1 " ") { s += $2 } END { print s + 0 }')
      [ "${used:-0}" -gt "$peak" ] && peak=$used
    fi
    sleep 0.2
  done
  local rc=0
  wait "$pid" || rc=$?
  echo "$peak" > "$OUT/$name.mem"
  return $rc
}

echo "bench/gpu: micro-batches $MICRO, warm-up $WARMUP + $STEPS timed steps, $ROUNDS round(s), peer attention $PEER_ATTN"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
status=0
for mb in $MICRO; do
  for r in $(seq "$ROUNDS"); do
    run_sampled "ours_${mb}_$r" "$BIN/dnallm-train" --config configs/dnabert-mlm.toml \
      --set training.micro_batch_size="$mb" --set training.grad_accum_steps=1 \
      --set training.max_steps=$((WARMUP + STEPS)) --set training.logging_steps=1 \
      --set training.eval_steps=0 --set training.device=cuda --set training.precision=bf16 \
      --set model.dropout=0 --set checkpoint.save_steps=0 --set checkpoint.save_final=false \
      --set checkpoint.resume=none --set checkpoint.dir="$OUT/ckpt_$mb" \
      --metrics-file "$OUT/ours_${mb}_$r.jsonl" --log-level warn ||
      { echo "ours at micro-batch $mb failed: see $OUT/ours_${mb}_$r.log" >&2; status=1; }
    run_sampled "peer_${mb}_$r" "$PYTHON" bench/gpu/hf_peer.py --micro-batch "$mb" \
      --warmup "$WARMUP" --steps "$STEPS" --attn "$PEER_ATTN" ||
      { echo "peer at micro-batch $mb failed: see $OUT/peer_${mb}_$r.log" >&2; status=1; }
  done
done
"$PYTHON" bench/gpu/summarize.py "$OUT" "$WARMUP" "$ROUNDS" $MICRO | tee "$OUT/table.txt"
echo "raw results: $OUT"
exit $status
