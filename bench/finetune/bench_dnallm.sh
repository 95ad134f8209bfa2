#!/usr/bin/env bash
# bench/finetune: the LoRA fine-tune preset (configs/finetune-lora-cpu.toml: a 2-layer, hidden
# 128 pre-LN BERT on overlapping 4-mers, LoRA r 8 / alpha 16 on query, key, value and dense,
# classification head, micro-batch 16, lr 2e-3, 10 warm-up steps, linear decay) on the labelled
# E. coli vs S. aureus windows of scripts/make-finetune-data.sh, in dnallm-train and in DNALLM
# (PyPI `dnallm`, DNATrainer on the Hugging Face Trainer: dnallm_peer.py), side by side:
# wall time of the training loop and tokens/s, same run, same threads, alternating ROUNDS times.
#
#   bench/finetune/bench_dnallm.sh [--python PATH] [build-dir]
#   env: STEPS (20), ROUNDS (2), THREADS (nproc), VARIANTS ("dnallm sdpa-fused"; also
#        "compile", see dnallm_peer.py), PYTHON (DNALLM's interpreter: $DNALLM_VENV-dnallm/bin/python,
#        made by scripts/install-deps.sh --bench)
#
# The base both start from: dnallm-train pre-trains configs/pretrain-small.toml for 10 steps
# (the weights do not matter for speed) and exports final/ (ours, model.init_from) and
# final/hf/ (what transformers loads: `esm`, WordLevel 4-mer tokenizer; DNALLM loads that).
# Both run as one process with THREADS threads and no evaluation. tokens/s counts the
# non-padding tokens of every sample trained on ([CLS] + 497 4-mers + [SEP] = 499 a window)
# over the training loop's wall time: our summary's wall_s, DNATrainer.train()'s duration.
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
PYTHON=${PYTHON:-$DNALLM_VENV-dnallm/bin/python}  # the peer: DNALLM's environment
bench_start "$@"
"$PYTHON" -c 'import dnallm' 2>/dev/null || {
  echo "bench_dnallm.sh: $PYTHON cannot import dnallm (scripts/install-deps.sh --bench makes" \
       "$DNALLM_VENV-dnallm; --python PATH picks another)" >&2
  exit 2
}
STEPS=${STEPS:-20}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
VARIANTS=${VARIANTS:-dnallm sdpa-fused}
bench_tmp
export OMP_NUM_THREADS=$THREADS
peer_versions=$("$PYTHON" -c 'import dnallm, torch, transformers; print(f"DNALLM {dnallm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")' 2>/dev/null)

scripts/make-finetune-data.sh "$TMP/data" 2000 500 > /dev/null
train_csv="$TMP/data/ecoli_vs_saureus_train.csv"
"$BUILD/bin/dnallm-train" --config configs/pretrain-small.toml --set training.max_steps=10 \
  --set checkpoint.dir="$TMP/base" --set checkpoint.save_final=true --set training.eval_steps=0 \
  --set logging.metrics_file="$TMP/base.jsonl" --log-level warn > "$TMP/base.log" 2>&1 ||
  { cat "$TMP/base.log"; exit 1; }
echo "bench/finetune: $STEPS steps x micro-batch 16, $ROUNDS rounds, threads $THREADS, $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "bench/finetune: ours $BUILD/bin/dnallm-train; peer $PYTHON ($peer_versions), variants: $VARIANTS"
for r in $(seq "$ROUNDS"); do
  start=$(date +%s.%N)
  "$BUILD/bin/dnallm-train" --config configs/finetune-lora-cpu.toml \
    --set model.init_from="$TMP/base/final" --set data.train_files="[\"$train_csv\"]" \
    --set data.eval_files="[]" --set training.eval_steps=0 --set training.max_steps="$STEPS" \
    --set training.logging_steps=1 --set checkpoint.dir="$TMP/ours_ck_$r" \
    --set checkpoint.save_final=false --set logging.metrics_file="$TMP/ours_$r.jsonl" \
    --log-level warn > "$TMP/ours_$r.log" 2>&1 || { cat "$TMP/ours_$r.log"; exit 1; }
  echo "$(date +%s.%N) - $start" | bc > "$TMP/ours_$r.process_s"
  for v in $VARIANTS; do
    start=$(date +%s.%N)
    "$PYTHON" bench/finetune/dnallm_peer.py --model "$TMP/base/final/hf" --train-csv "$train_csv" \
      --steps "$STEPS" --threads "$THREADS" --variant "$v" --out "$TMP/peer_${v}_$r" \
      > "$TMP/peer_${v}_$r.json" 2> "$TMP/peer_${v}_$r.log" || {
      echo "bench/finetune: DNALLM variant $v failed:" >&2; tail -5 "$TMP/peer_${v}_$r.log" >&2; }
    echo "$(date +%s.%N) - $start" | bc > "$TMP/peer_${v}_$r.process_s"
  done
done
"$PYTHON" - "$TMP" "$ROUNDS" "$VARIANTS" "$STEPS" <<'PY'
import json, os, statistics, sys
tmp, rounds, variants, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4])
tokens = steps * 16 * 499
def proc(path):
    return float(open(path).read())
ours = []
for r in range(1, rounds + 1):
    lines = [json.loads(l) for l in open(f"{tmp}/ours_{r}.jsonl")]
    s = [l for l in lines if l.get("event") == "summary"][0]
    ours.append((s["wall_s"], proc(f"{tmp}/ours_{r}.process_s"), s["final_loss"]))
rows = [("dnallm-train", ours)]
for v in variants:
    runs = []
    for r in range(1, rounds + 1):
        p = f"{tmp}/peer_{v}_{r}.json"
        if os.path.getsize(p) == 0:
            continue
        j = json.loads(open(p).read().strip().splitlines()[-1])
        runs.append((j["train_s"], proc(f"{tmp}/peer_{v}_{r}.process_s"), j["train_loss"]))
        name = f"DNALLM {j['dnallm']} {v} ({j['attn_implementation']})"
    if runs:
        rows.append((name, runs))
om = statistics.median(t for t, _, _ in ours)
print(f"{'impl':<36}{'runs':>5}{'train_s':>9}{'process_s':>11}{'tokens/s':>10}{'ours/peer':>10}")
for name, runs in rows:
    m = statistics.median(t for t, _, _ in runs)
    pm = statistics.median(p for _, p, _ in runs)
    ratio = "" if name == "dnallm-train" else f"{m / om:.2f}x"
    print(f"{name:<36}{len(runs):>5}{m:>9.1f}{pm:>11.1f}{tokens / m:>10.0f}{ratio:>10}")
print(f"train_s: the training loop's wall time (median); process_s: the whole process (start-up,"
      f" data, model load); tokens/s = {tokens} non-padding tokens / train_s; ours/peer on train_s")
PY
