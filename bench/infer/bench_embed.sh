#!/usr/bin/env bash
# bench/infer: embedding throughput of `dnallm-infer embed` vs a PyTorch batch loop over the
# same weights (embed_peer.py), same run, same threads, alternating ROUNDS times. The model is
# a freshly initialised export of configs/bench-cpu.toml's shape (BERT, char tokens, hidden 256,
# 4 layers, seq 512) written by dnallm-train (1 step); the input is N windows of the bundled
# E. coli genome, of random lengths in [MIN_LEN, MAX_LEN] bases. Checks that both give the
# same embeddings (max |diff|) before printing the ratio ours / peer of sequences per second.
#
#   bench/infer/bench_embed.sh [build dir]
#   env: N (512), MIN_LEN (50), MAX_LEN (500), BATCH (32), ROUNDS (2), THREADS (nproc),
#        PYTHON (/usr/bin/python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
N=${N:-512}
MIN_LEN=${MIN_LEN:-50}
MAX_LEN=${MAX_LEN:-500}
BATCH=${BATCH:-32}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
PYTHON=${PYTHON:-/usr/bin/python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=$THREADS

"$BUILD/bin/dnallm-train" --config configs/bench-cpu.toml --set training.max_steps=1 \
  --set checkpoint.dir="$TMP/ck" --set checkpoint.save_steps=0 --set checkpoint.save_final=true --set training.eval_steps=0 \
  --log-level warn >/dev/null
"$PYTHON" - "$TMP/in.fa" "$N" "$MIN_LEN" "$MAX_LEN" <<'PY'
import gzip, random, sys
path, n, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = "".join(l.strip() for l in gzip.open("data/ecoli_k12_mg1655.fa.gz", "rt") if not l.startswith(">"))
rng = random.Random(1)
with open(path, "w") as f:
    for i in range(n):
        L = rng.randint(lo, hi); s = rng.randrange(0, len(g) - L)
        f.write(f">w{i}\n{g[s:s+L]}\n")
PY
echo "bench/infer embed: $N sequences of $MIN_LEN-$MAX_LEN bases, batch $BATCH, threads $THREADS, $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
  "$BUILD/bin/dnallm-infer" embed --device cpu --model "$TMP/ck/final" --input "$TMP/in.fa" \
    --out "$TMP/ours.npy" --batch-size "$BATCH" 2> "$TMP/ours_$r.log"
  "$PYTHON" bench/infer/embed_peer.py --model "$TMP/ck/final" --fasta "$TMP/in.fa" \
    --out "$TMP/peer.npy" --batch "$BATCH" --threads "$THREADS" > "$TMP/peer_$r.json"
done
"$PYTHON" - "$TMP" "$ROUNDS" <<'PY'
import json, re, statistics, sys
import numpy as np
tmp, rounds = sys.argv[1], int(sys.argv[2])
ours, peer = [], []
for r in range(1, rounds + 1):
    m = re.search(r"embed: (\d+) in ([0-9.]+) s", open(f"{tmp}/ours_{r}.log").read())
    ours.append(int(m.group(1)) / float(m.group(2)))
    peer.append(json.load(open(f"{tmp}/peer_{r}.json"))["seq_per_s"])
a, b = np.load(f"{tmp}/ours.npy"), np.load(f"{tmp}/peer.npy")
diff = float(np.abs(a - b).max())
print(f"{'side':<8} {'rounds':>6} {'median seq/s':>13} {'best seq/s':>11}")
print(f"{'ours':<8} {rounds:>6} {statistics.median(ours):>13.1f} {max(ours):>11.1f}")
print(f"{'pytorch':<8} {rounds:>6} {statistics.median(peer):>13.1f} {max(peer):>11.1f}")
print(f"ratio ours/pytorch (medians): {statistics.median(ours) / statistics.median(peer):.2f}x"
      f"   same embeddings: max |diff| = {diff:.2e} over {a.shape}")
PY
