#!/usr/bin/env bash
# bench/train: dnallm-train vs the same model in PyTorch (torch_peer.py), same run, same
# thread count. The bench-cpu shape (configs/bench-cpu.toml): BERT MLM, char tokens, hidden
# 256, 4 layers, 4 heads, FFN 1024, seq 512, micro-batch 8, fp32, AdamW lr 3e-4, 15% masking.
#
#   bench/train/bench_train.sh [path/to/dnallm-train]
#   env: WARMUP (3), STEPS (5), THREADS (nproc), PYTHON (/usr/bin/python3)
#
# Reports the median step time of the timed steps (warm-up steps excluded) as tokens/s.
set -euo pipefail
cd "$(dirname "$0")/../.."
TRAIN=${1:-build/bin/dnallm-train}
WARMUP=${WARMUP:-3}
STEPS=${STEPS:-5}
THREADS=${THREADS:-$(nproc)}
PYTHON=${PYTHON:-/usr/bin/python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=$THREADS

echo "bench/train: warmup $WARMUP, timed $STEPS, threads $THREADS, $(nproc) cores"
"$TRAIN" --config configs/bench-cpu.toml --set training.max_steps=$((WARMUP + STEPS)) \
  --set training.logging_steps=1 --set checkpoint.save_final=false \
  --metrics-file "$TMP/metrics.jsonl" --log-level warn
OURS=$("$PYTHON" - "$TMP/metrics.jsonl" "$WARMUP" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [l for l in lines if "event" not in l and l["step"] > int(sys.argv[2])]
med = statistics.median(l["step_s"] for l in steps)
tokens = 8 * 512
print(json.dumps({"step_s_median": med, "tokens_per_s": tokens / med,
                  "final_loss": steps[-1]["loss"]}))
PY
)
PEER=$("$PYTHON" bench/train/torch_peer.py --warmup "$WARMUP" --steps "$STEPS" --threads "$THREADS")
"$PYTHON" - "$OURS" "$PEER" <<'PY'
import json, sys
ours, peer = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"{'impl':<14}{'step_s(median)':>16}{'tokens/s':>12}{'loss':>9}")
print(f"{'dnallm-train':<14}{ours['step_s_median']:>16.3f}{ours['tokens_per_s']:>12.0f}{ours['final_loss']:>9.4f}")
print(f"{'pytorch ' + peer['torch']:<14}{peer['step_s_median']:>16.3f}{peer['tokens_per_s']:>12.0f}{peer['final_loss']:>9.4f}")
print(f"ratio (dnallm-train / pytorch tokens/s): {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x")
PY
