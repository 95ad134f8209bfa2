#!/usr/bin/env bash
# bench/train: dnallm-train vs the same model in PyTorch (torch_peer.py), same run, same
# thread count. The bench-cpu shape (configs/bench-cpu.toml): BERT MLM, char tokens, hidden
# 256, 4 layers, 4 heads, FFN 1024, seq 512, micro-batch 8, fp32, AdamW lr 3e-4, 15% masking.
#
#   bench/train/bench_train.sh [path/to/dnallm-train]
#   env: WARMUP (3), STEPS (5), ROUNDS (2), THREADS (nproc), PYTHON (/usr/bin/python3)
#
# The two run alternately ROUNDS times (so background load hits both alike); the table
# reports, over all timed steps (warm-up steps excluded), the median and the best step time
# and tokens/s = 8 x 512 / median step time. Ratio = ours / peer on the medians.
set -euo pipefail
cd "$(dirname "$0")/../.."
TRAIN=${1:-build/bin/dnallm-train}
WARMUP=${WARMUP:-3}
STEPS=${STEPS:-5}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
PYTHON=${PYTHON:-/usr/bin/python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=$THREADS

echo "bench/train: warmup $WARMUP, timed $STEPS x $ROUNDS rounds, threads $THREADS, $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
  "$TRAIN" --config configs/bench-cpu.toml --set training.max_steps=$((WARMUP + STEPS)) \
    --set training.logging_steps=1 --set checkpoint.save_final=false \
    --metrics-file "$TMP/ours_$r.jsonl" --log-level warn
  "$PYTHON" bench/train/torch_peer.py --warmup "$WARMUP" --steps "$STEPS" --threads "$THREADS" \
    > "$TMP/peer_$r.json"
done
"$PYTHON" - "$TMP" "$WARMUP" "$ROUNDS" <<'PY'
import json, statistics, sys
tmp, warmup, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ours, peer, ours_loss, peer_loss, version = [], [], None, None, ""
for r in range(1, rounds + 1):
    lines = [json.loads(l) for l in open(f"{tmp}/ours_{r}.jsonl")]
    steps = [l for l in lines if "event" not in l and l["step"] > warmup]
    ours += [l["step_s"] for l in steps]
    ours_loss = steps[-1]["loss"]
    p = json.load(open(f"{tmp}/peer_{r}.json"))
    peer += p["step_s"]
    peer_loss, version = p["final_loss"], p["torch"]
tok = 8 * 512
rows = [("dnallm-train", ours, ours_loss), ("pytorch " + version, peer, peer_loss)]
print(f"{'impl':<18}{'steps':>6}{'median_s':>10}{'best_s':>9}{'tokens/s':>10}{'loss':>9}")
for name, t, loss in rows:
    m = statistics.median(t)
    print(f"{name:<18}{len(t):>6}{m:>10.3f}{min(t):>9.3f}{tok / m:>10.0f}{loss:>9.4f}")
print(f"ratio (dnallm-train / pytorch tokens/s, medians): "
      f"{statistics.median(peer) / statistics.median(ours):.2f}x"
      f"  (best steps: {min(peer) / min(ours):.2f}x)")
PY
