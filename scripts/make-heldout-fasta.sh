#!/usr/bin/env bash
# Writes the held-out tail of a bundled genome as FASTA, for `dnallm-eval --fasta`: the last
# FRACTION of the sequence, exactly the bases that data.eval_fraction = FRACTION keeps out of
# training (floor(length x FRACTION) bases), so a model trained with that setting never saw them.
#   scripts/make-heldout-fasta.sh [GENOME.fa.gz] [FRACTION] [OUT.fa]
# Default: the last 5% of E. coli K-12 -> runs/heldout/ecoli_k12_last5pct.fa
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
genome=${1:-$root/data/ecoli_k12_mg1655.fa.gz}
fraction=${2:-0.05}
out=${3:-$root/runs/heldout/ecoli_k12_last5pct.fa}
mkdir -p "$(dirname "$out")"
records=$(zcat -f "$genome" | grep -c '^>' || true)
if [ "$records" != 1 ]; then
  echo "make-heldout-fasta: $genome has $records FASTA records; give a one-record genome" >&2
  exit 3
fi
zcat -f "$genome" | grep -v '^>' | tr -d '\n' |
  awk -v f="$fraction" -v name="$(basename "$genome")" '
  { len = length($0); held = int(len * f)
    if (held <= 0) { print "make-heldout-fasta: fraction " f " holds out nothing" > "/dev/stderr"; exit 2 }
    print ">" name " held-out tail " len - held + 1 "-" len
    for (i = len - held + 1; i <= len; i += 80) print substr($0, i, 80) }' > "$out"
echo "make-heldout-fasta: $out ($(grep -v '^>' "$out" | tr -d '\n' | wc -c) bases)"
