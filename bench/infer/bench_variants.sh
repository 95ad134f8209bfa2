#!/usr/bin/env bash
# bench/infer: zero-shot variant scoring (Note [Zero-shot variant effects]) of `dnallm-infer
# variants` vs the Python loop over transformers a user writes (variants_peer.py: each SNV's
# windows through the model, causal ref + alt as one batch of 2), on the same Hugging Face
# directories (make_hub_models.py: a Llama causal LM with one token a base and an ESM masked LM
# with NT's 6-mers, hidden 256, 4 layers), same threads, same run, alternating ROUNDS times.
# The input: N random SNVs of the bundled E. coli genome's first 200 kb (seed 3), windows of
# WINDOW bases. Checks that both give the same scores (max |diff|) before printing the ratio
# ours / peer of variants per second. Also embeddings of the same hub directories (sequences/s,
# dnallm-infer embed vs a transformers loop), goal of issue 40: >= 3x for variants.
#
#   bench/infer/bench_variants.sh [--python PATH]... [build dir]
#   env: N (200), WINDOW (200), BATCH (16), ROUNDS (2), THREADS (nproc), PYTHON ($DNALLM_PYTHON),
#        EMBED_N (256 windows of 100-400 bases for the embedding rows)
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
bench_start "$@"
N=${N:-200}
EMBED_N=${EMBED_N:-256}
WINDOW=${WINDOW:-200}
BATCH=${BATCH:-16}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
bench_tmp
export OMP_NUM_THREADS=$THREADS

"$PYTHON" bench/infer/make_hub_models.py "$TMP/hub"
"$PYTHON" - "$TMP" "$N" <<'PY'
import gzip, random, sys
tmp, n = sys.argv[1], int(sys.argv[2])
genome = "".join(l.strip() for l in gzip.open("data/ecoli_k12_mg1655.fa.gz", "rt")
                 if not l.startswith(">"))[:200000]
with open(f"{tmp}/ref.fa", "w") as f:
    f.write(">chr\n" + "\n".join(genome[i:i + 60] for i in range(0, len(genome), 60)) + "\n")
rng = random.Random(3)
with open(f"{tmp}/v.vcf", "w") as f:
    f.write("##fileformat=VCFv4.2\n##contig=<ID=chr>\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n")
    for pos in sorted(rng.sample(range(len(genome)), n)):
        ref = genome[pos]
        if ref not in "ACGT":
            continue
        alt = rng.choice([b for b in "ACGT" if b != ref])
        f.write(f"chr\t{pos + 1}\t.\t{ref}\t{alt}\t.\t.\t.\n")
PY
echo "bench/infer variants: $N SNVs, window $WINDOW, batch $BATCH, threads $THREADS, $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "  ours: $BUILD/bin/dnallm-infer variants / embed; peers: transformers loops (variants_peer.py, hub_embed_peer.py)"
bench_describe_peers
"$PYTHON" bench/infer/make_windows.py "$TMP/windows.fa" "$EMBED_N" 100 400
for r in $(seq "$ROUNDS"); do
  for kind in causal masked; do
    bench_timed "$TMP/ours_embed_${kind}_$r.time" \
      "$BUILD/bin/dnallm-infer" embed --device cpu --model "$TMP/hub/$kind" --input "$TMP/windows.fa" \
      --batch-size 32 --out "$TMP/ours_embed_$kind.npy" --log-level warn
    (cd bench/infer && "$PYTHON" hub_embed_peer.py --model "$TMP/hub/$kind" --fasta "$TMP/windows.fa" \
      --batch 32 --threads "$THREADS" --out "$TMP/peer_embed_$kind.npy") > "$TMP/peer_embed_${kind}_$r.json"
    bench_timed "$TMP/ours_${kind}_$r.time" \
      "$BUILD/bin/dnallm-infer" variants --device cpu --model "$TMP/hub/$kind" --reference "$TMP/ref.fa" \
      --vcf "$TMP/v.vcf" --window "$WINDOW" --batch-size "$BATCH" --out "$TMP/ours_$kind.tsv" \
      --log-level warn
    "$PYTHON" bench/infer/variants_peer.py --model "$TMP/hub/$kind" --reference "$TMP/ref.fa" \
      --vcf "$TMP/v.vcf" --window "$WINDOW" --threads "$THREADS" --out "$TMP/peer_$kind.tsv" \
      > "$TMP/peer_${kind}_$r.json"
  done
done
"$PYTHON" - "$TMP" "$ROUNDS" <<'PY'
import json, statistics, sys
import numpy as np
tmp, rounds = sys.argv[1], int(sys.argv[2])
def rows(path):
    with open(path) as f:
        return [l.rstrip("\n").split("\t") for l in f][1:]
def header(unit):
    print(f"{'model':<8} {'side':<14} {'rounds':>6} {'median ' + unit:>13} {'ours/peer':>10} {'max |diff|':>11}")
def report(kind, name, count, key, diff):
    """A model's two rows: the medians over the rounds of `count` items over our process's wall
    time (ours_<name>_<round>.time) and of the peer's own rate (peer_<name>_<round>.json)."""
    ours = []
    for r in range(1, rounds + 1):
        s, e = map(float, open(f"{tmp}/ours_{name}_{r}.time").read().split())
        ours.append(count / (e - s))
    peer = [json.load(open(f"{tmp}/peer_{name}_{r}.json"))[key] for r in range(1, rounds + 1)]
    om, pm = statistics.median(ours), statistics.median(peer)
    print(f"{kind:<8} {'dnallm-infer':<14} {rounds:>6} {om:>13.1f}")
    print(f"{kind:<8} {'transformers':<14} {rounds:>6} {pm:>13.1f} {om / pm:>9.2f}x {diff:>11.2e}")
header("var/s")
for kind in ("causal", "masked"):
    ours_rows, peer_rows = rows(f"{tmp}/ours_{kind}.tsv"), rows(f"{tmp}/peer_{kind}.tsv")
    assert [r[:4] for r in ours_rows] == [r[:4] for r in peer_rows], "different variants scored"
    diff = max(abs(float(a[4]) - float(b[4])) for a, b in zip(ours_rows, peer_rows))
    report(kind, kind, len(ours_rows), "variants_per_s", diff)
header("seq/s")
for kind in ("causal", "masked"):
    a, b = np.load(f"{tmp}/ours_embed_{kind}.npy"), np.load(f"{tmp}/peer_embed_{kind}.npy")
    report(kind, f"embed_{kind}", len(a), "seq_per_s", float(np.abs(a - b).max()))
print("ours/peer on the medians; ours includes process start and model load, the peer's loop "
      "excludes them")
PY
