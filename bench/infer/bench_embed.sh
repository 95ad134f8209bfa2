#!/usr/bin/env bash
# bench/infer: embedding throughput of `dnallm-infer embed` vs a PyTorch batch loop over the
# same weights (embed_peer.py), same run, same threads, alternating ROUNDS times. The model is
# a freshly initialised export of configs/bench-cpu.toml's shape (BERT, char tokens, hidden 256,
# 4 layers, seq 512) written by dnallm-train (1 step); the input is N windows of the bundled
# E. coli genome, of random lengths in [MIN_LEN, MAX_LEN] bases. Checks that both give the
# same embeddings (max |diff|) before printing the ratio ours / peer of sequences per second.
#
#   bench/infer/bench_embed.sh [--python PATH]... [build dir]
#   env: N (512), MIN_LEN (50), MAX_LEN (500), BATCH (32), ROUNDS (2), THREADS (nproc),
#        PYTHON ($DNALLM_PYTHON: the peer's torch), VARIANTS ("eager sdpa compile", embed_peer.py)
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
bench_start "$@"
VARIANTS=${VARIANTS:-eager sdpa compile}
N=${N:-512}
MIN_LEN=${MIN_LEN:-50}
MAX_LEN=${MAX_LEN:-500}
BATCH=${BATCH:-32}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
bench_tmp
export OMP_NUM_THREADS=$THREADS

"$BUILD/bin/dnallm-train" --config configs/bench-cpu.toml --set training.max_steps=1 \
  --set checkpoint.dir="$TMP/ck" --set checkpoint.save_steps=0 --set checkpoint.save_final=true --set training.eval_steps=0 \
  --log-level warn >/dev/null
"$PYTHON" bench/infer/make_windows.py "$TMP/in.fa" "$N" "$MIN_LEN" "$MAX_LEN"
echo "bench/infer embed: $N sequences of $MIN_LEN-$MAX_LEN bases, batch $BATCH, threads $THREADS, $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "  ours: $BUILD/bin/dnallm-infer"
bench_describe_peers
echo "  peer variants: $VARIANTS"
for r in $(seq "$ROUNDS"); do
  "$BUILD/bin/dnallm-infer" embed --device cpu --model "$TMP/ck/final" --input "$TMP/in.fa" \
    --out "$TMP/ours.npy" --batch-size "$BATCH" 2> "$TMP/ours_$r.log"
  for pi in "${!PYTHONS[@]}"; do
    for v in $VARIANTS; do
      "${PYTHONS[$pi]}" bench/infer/embed_peer.py --model "$TMP/ck/final" --fasta "$TMP/in.fa" \
        --variant "$v" --out "$TMP/peer_${pi}_$v.npy" --batch "$BATCH" --threads "$THREADS" \
        > "$TMP/peer_${pi}_${v}_$r.json" 2> "$TMP/peer_${pi}_${v}_$r.log" || {
        echo "bench/infer: peer ${PYTHONS[$pi]} variant $v failed:" >&2; tail -5 "$TMP/peer_${pi}_${v}_$r.log" >&2; }
    done
  done
done
bench_summary "$TMP" "$ROUNDS" "$VARIANTS" "${#PYTHONS[@]}" <<'PY'
import re, statistics, sys
import numpy as np
from summary import peer_runs
tmp, rounds, variants, n_py = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4])
ours = []
for r in range(1, rounds + 1):
    m = re.search(r"embed: (\d+) in ([0-9.]+) s", open(f"{tmp}/ours_{r}.log").read())
    ours.append(int(m.group(1)) / float(m.group(2)))
a = np.load(f"{tmp}/ours.npy")
om = statistics.median(ours)
print(f"{'side':<30} {'rounds':>6} {'median seq/s':>13} {'best seq/s':>11} {'ours/peer':>10} {'max |diff|':>11}")
print(f"{'dnallm-infer':<30} {rounds:>6} {om:>13.1f} {max(ours):>11.1f}")
for pi in range(n_py):
  for v in variants:
    runs = peer_runs(f"{tmp}/peer_{pi}_{v}_{r}.json" for r in range(1, rounds + 1))
    if not runs:
        continue
    peer = [p["seq_per_s"] for p in runs]
    diff = float(np.abs(a - np.load(f"{tmp}/peer_{pi}_{v}.npy")).max())
    name = f"torch {runs[0]['torch']} {v}"
    print(f"{name:<30} {len(peer):>6} {statistics.median(peer):>13.1f} {max(peer):>11.1f}"
          f" {om / statistics.median(peer):>9.2f}x {diff:>11.2e}")
    if v == "compile":
        print(f"  (compile: the first batch, compilation included, took {statistics.median(p['first_batch_s'] for p in runs):.1f} s of each loop)")
print(f"ours/peer = sequences/s ratio on the medians (above 1: dnallm-infer is faster); embeddings over {a.shape}")
PY
