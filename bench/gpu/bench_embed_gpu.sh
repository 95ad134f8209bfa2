#!/usr/bin/env bash
# bench/gpu: `dnallm-infer embed` on one GPU against transformers' AutoModel (hf_embed_peer.py,
# SDPA) on the same export of configs/dnabert-mlm.toml's shape (freshly initialised, 1 step),
# the same N windows of the bundled E. coli genome (random lengths MIN_LEN..MAX_LEN bases),
# the same batch size, mean pooling, fp32, alternating ROUNDS times. Prints sequences/s of
# each side, the ratio ours / peer, and max |diff| of the embeddings; the table also lands in
# OUT/table.txt. Builds nothing (scripts/build.sh --cuda first).
#   bench/gpu/bench_embed_gpu.sh [--bin DIR] [--out DIR]
#   env: N (4096), MIN_LEN (200), MAX_LEN (2000), BATCH (64), ROUNDS (2), PYTHON (python3),
#        DEVICE (cuda; cpu tries the script on a machine without a GPU)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=build-cuda/bin
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "bench_embed_gpu.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
N=${N:-4096}
MIN_LEN=${MIN_LEN:-200}
MAX_LEN=${MAX_LEN:-2000}
BATCH=${BATCH:-64}
ROUNDS=${ROUNDS:-2}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
"$BIN/dnallm-train" --config configs/dnabert-mlm.toml --set training.max_steps=1 \
  --set checkpoint.dir="$OUT/ck" --set checkpoint.save_steps=0 --set checkpoint.save_final=true \
  --set checkpoint.resume=none --set training.eval_steps=0 --log-level warn >/dev/null
"$PYTHON" bench/infer/make_windows.py "$OUT/in.fa" "$N" "$MIN_LEN" "$MAX_LEN"
for r in $(seq "$ROUNDS"); do
  "$BIN/dnallm-infer" embed --device "$DEVICE" --model "$OUT/ck/final" --input "$OUT/in.fa" \
    --out "$OUT/ours.npy" --batch-size "$BATCH" 2> "$OUT/ours_$r.log"
  "$PYTHON" bench/gpu/hf_embed_peer.py --model "$OUT/ck/final/hf" --fasta "$OUT/in.fa" \
    --out "$OUT/peer.npy" --batch "$BATCH" --device "$DEVICE" > "$OUT/peer_$r.json"
done
"$PYTHON" - "$OUT" "$ROUNDS" "$N" "$BATCH" <<'PY' | tee "$OUT/table.txt"
import json, re, statistics, sys
import numpy as np
out, rounds, n, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ours, peer = [], []
for r in range(1, rounds + 1):
    m = re.search(r"embed: (\d+) in ([0-9.]+) s", open(f"{out}/ours_{r}.log").read())
    ours.append(int(m.group(1)) / float(m.group(2)))
    peer.append(json.load(open(f"{out}/peer_{r}.json"))["seq_per_s"])
a, b = np.load(f"{out}/ours.npy"), np.load(f"{out}/peer.npy")
print(f"embed on the GPU, {n} sequences, batch {batch}, fp32: dnallm-infer "
      f"{statistics.median(ours):.1f} seq/s, transformers AutoModel {statistics.median(peer):.1f} "
      f"seq/s, ours/peer {statistics.median(ours) / statistics.median(peer):.2f}x, "
      f"max |diff| {float(np.abs(a - b).max()):.2e}")
PY
