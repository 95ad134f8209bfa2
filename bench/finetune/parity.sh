#!/usr/bin/env bash
# bench/finetune/parity.sh: does a whole fine-tune with dnallm-train give the model the Hugging
# Face Trainer gives? (issue 43). The same base directory, the same GUE-layout task, the same
# hyperparameters (configs/gue-finetune.toml's), several seeds, through
#   ours  scripts/gue-finetune.sh (dnallm-launch, 2 ranks x micro 16, dnallm-eval on test), and
#   hf    transformers' Trainer with the model's reference code (hf_trainer_peer.py: batch 32,
#         its own RandomSampler, load_best_model_at_end on the dev loss, predict on test),
# in full fine-tuning and LoRA; then the mean +/- std of test MCC and accuracy per system, a
# Welch t-test of ours against the Trainer (scipy), the k-mer baseline of each task
# (scripts/kmer-baseline.py) and the wall time per run, as a markdown table (docs/models.md).
#
#   bench/finetune/parity.sh [--out DIR] [--seeds "1 2 3 4 5"] [--bases "dnabert2 ntv2"]
#                            [--tasks "ecoli_strand ecoli_coding3"] [--modes "full lora"]
#                            [build-dir]
#   env: DNALLM_DNABERT2_REF, DNALLM_NT_V2_CODE (the reference code: tests/hf/README, a base
#        without its code is skipped with a message); PYTHON (an interpreter with torch,
#        transformers, peft, scikit-learn and scipy: default the benchmark environment
#        $DNALLM_VENV-dnallm of scripts/install-deps.sh --bench); BASE_STEPS (400: pre-training
#        steps of each base), LR (5e-4), EPOCHS (3), EVAL_STEPS (48: each epoch), DROPOUT
#        (0.1), ROWS ("1536 288 576": train/dev/test rows of each task), THREADS (per run)
#
# The bases (made here, by our pre-training and our export, so both systems read the same
# files): "dnabert2" configs/dnabert2-tiny.toml's architecture (ALiBi, post-LN, GEGLU) at hidden
# 64 x 2 layers, single-base tokens, exported in DNABERT-2's layout (its bert_layers.py reads
# it); "ntv2" an NT-v2 of hidden 64 x 2 layers (rotary, SwiGLU without bias, 6-mers)
# initialised with NT-v2's code (make_nt_v2_init.py), pre-trained by dnallm-train and exported
# in NT-v2's layout. Each is pre-trained BASE_STEPS masked-LM steps on E. coli.
# The learning rate is the one departure from gue-finetune.toml (3e-5 is for a 117M-parameter
# DNABERT-2; these bases have well under 1M parameters, and at 3e-5 neither system learns
# much in 3 epochs of 1,536 rows): LR for both systems.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
. scripts/python-env.sh
PYTHON=${PYTHON:-$DNALLM_VENV-dnallm/bin/python}
out=runs/parity seeds="1 2 3 4 5" bases="dnabert2 ntv2" tasks="ecoli_strand ecoli_coding3"
modes="full lora"
pos=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --bases) bases=$2; shift 2 ;;
    --tasks) tasks=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) pos+=("$1"); shift ;;
  esac
done
BUILD=$(cd "${pos[0]:-build}" && pwd)
"$PYTHON" -c 'import torch, transformers, peft, sklearn, scipy' 2>/dev/null || {
  echo "parity.sh: $PYTHON cannot import torch, transformers, peft, scikit-learn and scipy" \
       "(scripts/install-deps.sh --bench makes $DNALLM_VENV-dnallm; PYTHON=... picks another)" >&2
  exit 2
}
BASE_STEPS=${BASE_STEPS:-300} LR=${LR:-5e-4} EPOCHS=${EPOCHS:-3} EVAL_STEPS=${EVAL_STEPS:-48}
DROPOUT=${DROPOUT:-0.1} THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
read -r n_train n_dev n_test <<<"${ROWS:-1536 288 576}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
results="$out/results.jsonl"
log() { echo "parity: $*" >&2; }

python3 scripts/make-gue-tasks.py --out "$out/tasks" --train "$n_train" --dev "$n_dev" \
  --test "$n_test" --tasks "$(tr ' ' , <<<"$tasks")" >&2
for t in $tasks; do
  [ -s "$out/tasks/$t/kmer.json" ] ||
    "$PYTHON" scripts/kmer-baseline.py --json "$out/tasks/$t" > "$out/tasks/$t/kmer.json"
done

# --- the bases -----------------------------------------------------------------------------
pretrain() {  # name, then dnallm-train arguments
  local name=$1; shift
  [ -f "$out/bases/$name/final/hf/config.json" ] && return 0
  log "pre-training the $name base ($BASE_STEPS steps)"
  "$BUILD/bin/dnallm-train" "$@" --set model.max_seq_length=130 \
    --set training.max_steps="$BASE_STEPS" --set training.micro_batch_size=16 \
    --set training.grad_accum_steps=1 --set training.lr=1e-3 --set training.lr_scheduler=linear \
    --set training.warmup_steps=$((BASE_STEPS / 10)) --set training.precision=fp32 \
    --set training.eval_steps=0 --set training.logging_steps=50 \
    --set checkpoint.dir="$out/bases/$name" --set checkpoint.save_steps=0 \
    --set logging.metrics_file="$out/bases/$name.jsonl" --set logging.tensorboard_dir= \
    --log-level warn > "$out/bases/$name.log" 2>&1 || { tail -20 "$out/bases/$name.log" >&2; exit 1; }
}
mkdir -p "$out/bases"
declare -A base_sets
for b in $bases; do
  case "$b" in
    dnabert2)
      [ -n "${DNALLM_DNABERT2_REF:-}" ] || { log "skip dnabert2: no DNALLM_DNABERT2_REF"; continue; }
      pretrain dnabert2 --config configs/dnabert2-tiny.toml --set model.hidden=64 \
        --set model.layers=2 --set model.heads=4 --set model.ffn=128
      base_sets[$b]="--set tokenizer.kind=char" ;;
    ntv2)
      [ -n "${DNALLM_NT_V2_CODE:-}" ] || { log "skip ntv2: no DNALLM_NT_V2_CODE"; continue; }
      [ -f "$out/bases/ntv2-init/config.json" ] ||
        "$PYTHON" bench/finetune/make_nt_v2_init.py --out "$out/bases/ntv2-init" --hidden 64 \
          --layers 2 --heads 4 --ffn 128 >&2
      pretrain ntv2 --config configs/nt-mlm.toml --set model.init_from="$out/bases/ntv2-init" \
        --set tokenizer.kind=nt
      base_sets[$b]="--set tokenizer.kind=nt --set tokenizer.k=6" ;;
    *) log "unknown base '$b' (dnabert2, ntv2)"; exit 2 ;;
  esac
done

# --- exactness first: from the same classifier, dropout off, our batch order, 20 steps ------
for b in $bases; do
  [ -n "${base_sets[$b]:-}" ] || continue
  [ -s "$out/exact-$b.txt" ] && continue
  sets=()
  for kv in ${base_sets[$b]}; do [ "$kv" = --set ] || sets+=(--set "$kv"); done
  "$PYTHON" tests/hf/check_finetune_parity.py --train "$BUILD/bin/dnallm-train" --source-dir . \
    --model "$out/bases/$b/final/hf" "${sets[@]}" --lr 3e-3 > "$out/exact-$b.txt" 2>&1 ||
    { cat "$out/exact-$b.txt" >&2; exit 1; }
  log "$b: $(head -1 "$out/exact-$b.txt")"
done

# --- the runs ------------------------------------------------------------------------------
record() {  # base task mode system seed wall json
  "$PYTHON" - "$@" >> "$results" <<'PY'
import json, sys
base, task, mode, system, seed, wall, body = sys.argv[1:8]
r = json.loads(body)
print(json.dumps({**r, "base": base, "task": task, "mode": mode, "system": system,
                  "seed": int(seed), "wall_s": float(wall)}))
PY
}
done_already() {  # base task mode system seed: is that run in results.jsonl?
  [ -f "$results" ] && python3 - "$results" "$@" <<'PY'
import json, sys
key = sys.argv[2:6] + [int(sys.argv[6])]
runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if any([r["base"], r["task"], r["mode"], r["system"], r["seed"]] == key
                  for r in runs) else 1)
PY
}
for b in $bases; do
  [ -n "${base_sets[$b]:-}" ] || continue
  base="$out/bases/$b/final/hf"
  for t in $tasks; do
    task="$out/tasks/$t"
    for m in $modes; do
      lora_r=0; [ "$m" = lora ] && lora_r=8
      # PEFT's targets for the same attention projections (DNABERT-2's are fused in Wqkv).
      hf_targets=query,value; [ "$b" = dnabert2 ] && hf_targets=Wqkv
      for s in $seeds; do
        run="$out/runs/$b/$t/$m"
        mkdir -p "$run"
        if ! done_already "$b" "$t" "$m" ours "$s"; then
          log "$b $t $m ours seed $s"
          t0=$(date +%s.%N)
          # shellcheck disable=SC2086
          OMP_NUM_THREADS=$((THREADS / 2 > 0 ? THREADS / 2 : 1)) scripts/gue-finetune.sh \
            --model "$base" --task "$task" --seeds "$s" --nproc 2 --out "$run/ours" \
            ${base_sets[$b]} --set training.lr="$LR" --set training.num_train_epochs="$EPOCHS" \
            --set training.eval_steps="$EVAL_STEPS" --set model.dropout="$DROPOUT" \
            --set lora.r="$lora_r" --set lora.alpha=16 --set lora.dropout=0.05 \
            --set 'lora.target_modules=["query", "value"]' --set logging.tensorboard_dir= \
            > "$run.ours.$s.log" 2>&1 || { tail -20 "$run.ours.$s.log" >&2; exit 1; }
          wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
          record "$b" "$t" "$m" ours "$s" "$wall" "$(python3 - "$run/ours/seed$s" <<'PY'
import json, sys
d = sys.argv[1]
test = json.load(open(f"{d}/test.json"))
lines = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
best = json.load(open(f"{d}/checkpoints/best/best.json"))
print(json.dumps({"test": {"mcc": test["mcc"], "accuracy": test["accuracy"], "f1": test["f1"]},
                  "best_step": best["step"],
                  "evals": [{"step": l["step"], "loss": l["loss"], "mcc": l.get("mcc"),
                             "accuracy": l.get("accuracy")} for l in lines
                            if l.get("event") == "eval"]}))
PY
)"
        fi
        if ! done_already "$b" "$t" "$m" hf "$s"; then
          log "$b $t $m hf seed $s"
          t0=$(date +%s.%N)
          "$PYTHON" bench/finetune/hf_trainer_peer.py --model "$base" --task "$task" --seed "$s" \
            --lr "$LR" --epochs "$EPOCHS" --eval-steps "$EVAL_STEPS" --dropout "$DROPOUT" \
            --lora-r "$lora_r" --lora-alpha 16 --lora-dropout 0.05 --lora-targets "$hf_targets" \
            --threads "$THREADS" --dnabert2-ref "${DNALLM_DNABERT2_REF:-}" \
            --nt-v2-code "${DNALLM_NT_V2_CODE:-}" --out "$run/hf-$s" \
            > "$run.hf.$s.json" 2> "$run.hf.$s.log" || { tail -20 "$run.hf.$s.log" >&2; exit 1; }
          wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
          rm -rf "$run/hf-$s"
          record "$b" "$t" "$m" hf "$s" "$wall" "$(tail -1 "$run.hf.$s.json")"
        fi
      done
    done
  done
done
"$PYTHON" bench/finetune/parity_report.py "$results" "$out/tasks" | tee "$out/table.md"
