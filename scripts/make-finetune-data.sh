#!/usr/bin/env bash
# Cuts labelled 500-base windows for the E. coli (label 0) vs S. aureus (label 1) fine-tune:
# training windows from the first 90% of each genome, evaluation windows from the last 10%
# (disjoint regions), at seeded random offsets. Windows with N are dropped.
#   scripts/make-finetune-data.sh [OUT_DIR] [TRAIN_PER_CLASS] [EVAL_PER_CLASS]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out=${1:-$root/runs/finetune-data}
train_n=${2:-2000}
eval_n=${3:-500}
mkdir -p "$out"
cut_windows() {  # fasta.gz label count region(train|eval) seed
  zcat "$1" | grep -v '^>' | tr -d '\n' | tr 'acgtn' 'ACGTN' |
    awk -v label="$2" -v n="$3" -v region="$4" -v seed="$5" -v w=500 '
    { seq = $0 }
    END {
      len = length(seq); split_at = int(len * 0.9)
      lo = region == "train" ? 1 : split_at + 1
      hi = region == "train" ? split_at - w : len - w
      srand(seed); made = 0; tries = 0
      while (made < n && tries < n * 20) {
        tries++
        start = lo + int(rand() * (hi - lo))
        win = substr(seq, start, w)
        if (win ~ /[^ACGT]/) continue
        print win "," label; made++
      }
    }'
}
for split in train eval; do
  n=$([ "$split" = train ] && echo "$train_n" || echo "$eval_n")
  {
    echo "sequence,label"
    { cut_windows "$root/data/ecoli_k12_mg1655.fa.gz" 0 "$n" "$split" 11
      cut_windows "$root/data/saureus_n315.fa.gz" 1 "$n" "$split" 13; } | shuf --random-source=<(yes)
  } > "$out/ecoli_vs_saureus_$split.csv"
  echo "make-finetune-data: $out/ecoli_vs_saureus_$split.csv ($((2 * n)) windows)"
done
