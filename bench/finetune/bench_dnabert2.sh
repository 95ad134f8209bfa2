#!/usr/bin/env bash
# bench/finetune: DNABERT-2-shaped full fine-tuning on the CPU, dnallm-train against DNABERT-2's
# own remote code (bert_layers.py under torch 2.15, its PyTorch attention path; the peer
# bench/finetune/dnabert2_peer.py), same model, same batches, same threads: tokens/s of the
# training loop and the ratio ours/peer (target >= 1.2x).
#
#   bench/finetune/bench_dnabert2.sh --dnabert2-ref DIR [--python PATH] [build-dir]
#   env: STEPS (10), BATCH (8), ROUNDS (2), THREADS (nproc), HIDDEN (256), LAYERS (4),
#        HEADS (4), FFN (1024); PYTHON (the peer's interpreter: the torch 2.15 environment
#        ~/.local/share/dnallm-dist/venv-215, which needs einops for DNABERT-2's code)
#
# The model: configs/dnabert2-tiny.toml's architecture (ALiBi, post-LN, GEGLU, token types)
# at HIDDEN/LAYERS/HEADS/FFN, single-base tokens, pre-trained 2 steps by dnallm-train (the
# weights do not matter for speed) and exported to final/hf in DNABERT-2's layout: both sides
# start from that directory (ours through model.init_from, the peer through
# AutoModelForSequenceClassification with trust_remote_code), new 2-label head, AdamW at a
# constant learning rate, dropout 0, fp32. The data: 500-base windows of
# scripts/make-finetune-data.sh (E. coli vs S. aureus), [CLS] + 500 + [SEP] = 502 tokens a row,
# no padding. tokens/s = STEPS x BATCH x 502 / the training loop's wall time (our summary's
# wall_s; the peer's loop).
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
PYTHON=${PYTHON:-$HOME/.local/share/dnallm-dist/venv-215/bin/python}
REF=${DNALLM_DNABERT2_REF:-}
pos=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYTHON=$2; shift 2 ;;
    --dnabert2-ref) REF=$2; shift 2 ;;
    *) pos+=("$1"); shift ;;
  esac
done
set -- "${pos[@]+"${pos[@]}"}"
[ -n "$REF" ] || {
  echo "bench_dnabert2.sh: give --dnabert2-ref DIR (DNABERT-2's bert_layers.py, bert_padding.py," \
       "configuration_bert.py) or DNALLM_DNABERT2_REF" >&2
  exit 2
}
"$PYTHON" -c 'import torch, transformers, einops' 2>/dev/null || {
  echo "bench_dnabert2.sh: $PYTHON cannot import torch, transformers and einops (pip install" \
       "einops into it; --python PATH picks another)" >&2
  exit 2
}
BUILD=${1:-build}
STEPS=${STEPS:-10}
BATCH=${BATCH:-8}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
HIDDEN=${HIDDEN:-256}
LAYERS=${LAYERS:-4}
HEADS=${HEADS:-4}
FFN=${FFN:-1024}
bench_tmp
export OMP_NUM_THREADS=$THREADS
peer_versions=$("$PYTHON" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')

scripts/make-finetune-data.sh "$TMP/data" 400 10 > /dev/null
train_csv="$TMP/data/ecoli_vs_saureus_train.csv"
shape=(--set model.hidden="$HIDDEN" --set model.layers="$LAYERS" --set model.heads="$HEADS"
       --set model.ffn="$FFN")
"$BUILD/bin/dnallm-train" --config configs/dnabert2-tiny.toml "${shape[@]}" \
  --set model.max_seq_length=512 --set training.max_steps=2 --set checkpoint.dir="$TMP/base" \
  --set logging.metrics_file="$TMP/base.jsonl" --log-level warn > "$TMP/base.log" 2>&1 ||
  { cat "$TMP/base.log"; exit 1; }
echo "bench/finetune dnabert2: hidden $HIDDEN, $LAYERS layers, $HEADS heads, FFN $FFN; $STEPS steps x batch $BATCH x 502 tokens, $ROUNDS rounds, threads $THREADS, $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "bench/finetune dnabert2: ours $BUILD/bin/dnallm-train; peer DNABERT-2's remote code, $PYTHON ($peer_versions)"
for r in $(seq "$ROUNDS"); do
  "$BUILD/bin/dnallm-train" --config configs/finetune-hf-dnabert.toml \
    --set model.init_from="$TMP/base/final/hf" --set tokenizer.kind=char \
    --set model.max_seq_length=512 --set lora.r=0 --set model.dropout=0 \
    --set data.train_files="[\"$train_csv\"]" --set data.eval_files="[]" \
    --set training.eval_steps=0 --set training.max_steps="$STEPS" \
    --set training.micro_batch_size="$BATCH" --set training.lr=5e-5 \
    --set training.lr_scheduler=constant --set training.warmup_ratio=0 \
    --set training.weight_decay=0 --set training.logging_steps=1 \
    --set checkpoint.dir="$TMP/ours_ck_$r" --set checkpoint.save_final=false \
    --set logging.tensorboard_dir= --set logging.metrics_file="$TMP/ours_$r.jsonl" \
    --log-level warn > "$TMP/ours_$r.log" 2>&1 || { cat "$TMP/ours_$r.log"; exit 1; }
  "$PYTHON" bench/finetune/dnabert2_peer.py --model "$TMP/base/final/hf" --dnabert2-ref "$REF" \
    --train-csv "$train_csv" --steps "$STEPS" --batch "$BATCH" --lr 5e-5 --threads "$THREADS" \
    > "$TMP/peer_$r.json" 2> "$TMP/peer_$r.log" || { tail -5 "$TMP/peer_$r.log" >&2; exit 1; }
done
"$PYTHON" - "$TMP" "$ROUNDS" "$STEPS" "$BATCH" <<'PY'
import json, statistics, sys
tmp, rounds, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tokens = steps * batch * 502
ours, peer = [], []
for r in range(1, rounds + 1):
    lines = [json.loads(l) for l in open(f"{tmp}/ours_{r}.jsonl")]
    s = [l for l in lines if l.get("event") == "summary"][0]
    ours.append(s["wall_s"])
    p = json.loads(open(f"{tmp}/peer_{r}.json").read().strip().splitlines()[-1])
    assert p["tokens"] == tokens, (p["tokens"], tokens)
    peer.append(p["train_s"])
om, pm = statistics.median(ours), statistics.median(peer)
print(f"{'impl':<34}{'rounds':>7}{'train_s':>9}{'tokens/s':>10}")
print(f"{'dnallm-train':<34}{rounds:>7}{om:>9.2f}{tokens / om:>10.0f}")
print(f"{'DNABERT-2 remote code (' + p['torch'] + ')':<34}{rounds:>7}{pm:>9.2f}{tokens / pm:>10.0f}")
print(f"ours/peer tokens/s: {pm / om:.2f}x (target >= 1.2x); train_s medians of {rounds} rounds, "
      f"rounds alternate ours then peer")
PY
