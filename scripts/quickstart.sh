#!/usr/bin/env bash
# From a fresh clone to a trained model: install what is missing, build the three programs it
# runs, pre-train a tiny DNA language model on the bundled E. coli genome with 2 local
# workers (about a minute on 2 cores), and score it on the held-out 5% of the genome against
# the order-0 baseline (the bits/base of guessing each base from its frequency).
# Extra arguments go to dnallm-launch, e.g. scripts/quickstart.sh --set training.max_steps=50
#
# The first run downloads about 3 GB (PyTorch's wheel, whose LibTorch we build against, with
# its CUDA libraries: the same build runs on GPUs), takes about 6 GB of disk and compiles for
# about 5 minutes on 2 cores, partly during the download (about 6 minutes in all from a fresh
# machine, docs/build.md); later runs install and build nothing. docs/install.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
# shellcheck source=python-env.sh
. "$root/scripts/python-env.sh"
start=$(date +%s)
[ -x "$build/bin/dnallm-train" ] ||
  echo "quickstart: installing what is missing and building dnallm-launch and dnallm-train (the" \
       "first time: about 6 minutes on 2 cores; later runs only what changed), then dnallm-eval" \
       "after training"
# The modules without LibTorch compile while PyTorch downloads (scripts/setup.sh).
"$root/scripts/setup.sh" --target dnallm-libraries
# Only what it runs, training's programs first (docs/build.md); scripts/test.sh reuses all of it.
"$root/scripts/build.sh" --target dnallm-launch --target dnallm-train
ready=$(date +%s)
cd "$root"
heldout=runs/heldout/ecoli_k12_last5pct.fa
[ -s "$heldout" ] || scripts/make-heldout-fasta.sh data/ecoli_k12_mg1655.fa.gz 0.05 "$heldout" >/dev/null
mkdir -p runs/quickstart
"$build/bin/dnallm-launch" --nproc-per-node 2 --config configs/quickstart-causal.toml \
  --set checkpoint.resume=none "$@"
trained=$(date +%s)
"$root/scripts/build.sh" --target dnallm-eval
built_eval=$(date +%s)
echo
echo "quickstart: scoring the model on the held-out 5% of the genome (never trained on)"
"$build/bin/dnallm-eval" --model runs/quickstart/checkpoints/final --fasta "$heldout" --max-bases 100000 \
  > runs/quickstart/heldout.json
python="$DNALLM_PYTHON"
[ -x "$python" ] || python=python3
"$python" - runs/quickstart/heldout.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
bpb, base = r["bits_per_base"], r["order0_bits_per_base"]
print(f"quickstart: held-out {r['bases']} bases: {bpb:.4f} bits/base; order-0 baseline {base:.4f}"
      f" bits/base ({(base - bpb) / base * 100:+.1f}% better)" if bpb < base else
      f"quickstart: held-out {r['bases']} bases: {bpb:.4f} bits/base, NOT better than the "
      f"order-0 baseline {base:.4f}: train longer (--set training.max_steps=...)")
PY
echo "quickstart: install+build $((ready - start)) s, training $((trained - ready)) s," \
     "dnallm-eval's build $((built_eval - trained)) s, total $(($(date +%s) - start)) s;" \
     "metrics in runs/quickstart/metrics.jsonl, model in runs/quickstart/checkpoints/final"
echo "quickstart: score any FASTA with"
echo "  $build/bin/dnallm-eval --model runs/quickstart/checkpoints/final --fasta FILE.fa"
