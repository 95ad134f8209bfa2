#!/usr/bin/env bash
# From a fresh clone to a trained model: install what is missing, build, and pre-train a
# tiny masked LM on the bundled E. coli genome with 2 local workers (about a minute on 2 cores).
# Extra arguments go to dnallm-launch, e.g. scripts/quickstart.sh --set training.max_steps=50
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
cd "$root"
mkdir -p runs/quickstart
"$build/bin/dnallm-launch" --nproc-per-node 2 --config configs/quickstart.toml \
  --set checkpoint.resume=none "$@"
echo
echo "quickstart: metrics in runs/quickstart/metrics.jsonl, model in runs/quickstart/checkpoints/final"
echo "quickstart: evaluate it with"
echo "  $build/bin/dnallm-eval --model runs/quickstart/checkpoints/final --fasta data/ecoli_k12_mg1655.fa.gz --max-bases 200000"
