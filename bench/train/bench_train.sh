#!/usr/bin/env bash
# bench/train: dnallm-train vs the same model in PyTorch (torch_peer.py), same run, same
# thread count. The bench-cpu shape (configs/bench-cpu.toml): BERT MLM, char tokens, hidden
# 256, 4 layers, 4 heads, FFN 1024, seq 512, micro-batch 8, fp32, AdamW lr 3e-4, 15% masking.
#
#   bench/train/bench_train.sh [--python PATH] [path/to/dnallm-train]
#   env: WARMUP (3), STEPS (5), ROUNDS (2), THREADS (nproc), PYTHON ($DNALLM_PYTHON),
#        VARIANTS ("eager sdpa-fused compile": the peer's variants, see torch_peer.py)
#
# Ours and every peer variant run alternately ROUNDS times (so background load hits all
# alike); the table reports, over all timed steps (warm-up steps excluded), the median and
# the best step time and tokens/s = 8 x 512 / median step time, and ours / peer on the medians
# for each variant. The peer runs on $PYTHON's torch (--python picks another venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/python.sh
pos=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYTHON=$2; shift 2 ;;
    *) pos+=("$1"); shift ;;
  esac
done
set -- "${pos[@]}"
bench_python_check
TRAIN=${1:-build/bin/dnallm-train}
WARMUP=${WARMUP:-3}
STEPS=${STEPS:-5}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
VARIANTS=${VARIANTS:-eager sdpa-fused compile}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=$THREADS

echo "bench/train: warmup $WARMUP, timed $STEPS x $ROUNDS rounds, threads $THREADS, $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "bench/train: ours $TRAIN; peer $PYTHON (torch $PEER_TORCH), variants: $VARIANTS"
for r in $(seq "$ROUNDS"); do
  "$TRAIN" --config configs/bench-cpu.toml --set training.max_steps=$((WARMUP + STEPS)) \
    --set training.logging_steps=1 --set checkpoint.save_final=false \
    --metrics-file "$TMP/ours_$r.jsonl" --log-level warn
  for v in $VARIANTS; do
    "$PYTHON" bench/train/torch_peer.py --variant "$v" --warmup "$WARMUP" --steps "$STEPS" \
      --threads "$THREADS" > "$TMP/peer_${v}_$r.json" 2> "$TMP/peer_${v}_$r.log" || {
      echo "bench/train: peer variant $v failed:" >&2; tail -5 "$TMP/peer_${v}_$r.log" >&2; }
  done
done
"$PYTHON" - "$TMP" "$WARMUP" "$ROUNDS" "$VARIANTS" <<'PY'
import json, os, statistics, sys
tmp, warmup, rounds, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
ours, ours_loss = [], None
for r in range(1, rounds + 1):
    lines = [json.loads(l) for l in open(f"{tmp}/ours_{r}.jsonl")]
    steps = [l for l in lines if "event" not in l and l["step"] > warmup]
    ours += [l["step_s"] for l in steps]
    ours_loss = steps[-1]["loss"]
rows = [("dnallm-train", ours, ours_loss)]
for v in variants:
    t, loss, version = [], None, ""
    for r in range(1, rounds + 1):
        path = f"{tmp}/peer_{v}_{r}.json"
        if os.path.getsize(path) == 0:
            continue
        p = json.load(open(path))
        t += p["step_s"]
        loss, version = p["final_loss"], p["torch"]
    if t:
        rows.append((f"torch {version} {v}", t, loss))
tok = 8 * 512
print(f"{'impl':<34}{'steps':>6}{'median_s':>10}{'best_s':>9}{'tokens/s':>10}{'loss':>9}{'ours/peer':>10}")
om = statistics.median(ours)
for name, t, loss in rows:
    m = statistics.median(t)
    ratio = "" if name == "dnallm-train" else f"{m / om:.2f}x"
    print(f"{name:<34}{len(t):>6}{m:>10.3f}{min(t):>9.3f}{tok / m:>10.0f}{loss:>9.4f}{ratio:>10}")
print("ours/peer = tokens/s ratio on the medians (above 1: dnallm-train is faster)")
PY
