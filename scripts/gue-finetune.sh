#!/usr/bin/env bash
# Fine-tunes a model on one GUE-layout task (DIR/train.csv, dev.csv, test.csv with
# sequence,label) once per seed with configs/gue-finetune.toml (the DNABERT-2 paper's protocol:
# best dev checkpoint, Note [Best checkpoint]), scores each seed's best checkpoint on test with
# dnallm-eval, and reports MCC, macro F1 and accuracy averaged over the seeds with their sample
# standard deviation (Note [Classification scores]: scikit-learn's definitions).
#   scripts/gue-finetune.sh --model DIR --task DIR [--seeds "1 2 3"] [--nproc N]
#                           [--out DIR] [--config FILE] [--set key=value]...
# Writes OUT/seed<S>/ (checkpoints/best, metrics.jsonl, test.json) and OUT/summary.json, and
# prints one line per seed and the summary. Exit 2 on a bad argument or task directory; a
# failed run's exit code otherwise.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
model="" task="" seeds="1 2 3" nproc=2 out="" config="$root/configs/gue-finetune.toml"
sets=()
usage() { echo "gue-finetune.sh: $1; see the header of scripts/gue-finetune.sh" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --task) task="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    *) usage "unknown argument '$1'" ;;
  esac
done
[[ -n "$model" ]] || usage "--model is required (a model directory: ours or Hugging Face's)"
[[ -n "$task" ]] || usage "--task is required (a directory with train.csv, dev.csv, test.csv)"
for f in train dev test; do
  [[ -f "$task/$f.csv" ]] || usage "$task/$f.csv not found (GUE layout: train.csv, dev.csv, test.csv)"
done
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || usage "--nproc must be a positive integer, not '$nproc'"
read -r -a seed_list <<<"$seeds"
[[ ${#seed_list[@]} -ge 1 ]] || usage "--seeds is empty"
for s in "${seed_list[@]}"; do [[ "$s" =~ ^[0-9]+$ ]] || usage "seed '$s' is not a number"; done
out="${out:-$root/runs/gue/$(basename "$task")}"
# The labels of the task: 0..K-1 in the label column (the second; header first).
labels=$(awk -F, 'NR > 1 && $NF != "" { if ($NF + 1 > k) k = $NF + 1 } END { print k + 0 }' \
  "$task/train.csv")
[[ "$labels" -ge 2 ]] || usage "$task/train.csv: fewer than 2 labels in its last column"
# The paper's global batch of 32 over the ranks.
micro=$(( (32 + nproc - 1) / nproc ))
mkdir -p "$out"
for s in "${seed_list[@]}"; do
  run="$out/seed$s"
  rm -rf "$run/checkpoints"
  "$build/bin/dnallm-launch" --nproc-per-node "$nproc" --config "$config" \
    --set "model.init_from=$model" --set "model.num_labels=$labels" \
    --set "data.train_files=[\"$task/train.csv\"]" --set "data.eval_files=[\"$task/dev.csv\"]" \
    --set "training.seed=$s" --set "training.micro_batch_size=$micro" \
    --set "checkpoint.dir=$run/checkpoints" --set "logging.metrics_file=$run/metrics.jsonl" \
    "${sets[@]}"
  [[ -f "$run/checkpoints/best/best.json" ]] || {
    echo "gue-finetune.sh: seed $s: no best checkpoint in $run/checkpoints/best (no evaluation" \
      "ran: is training shorter than training.eval_steps?)" >&2
    exit 1
  }
  "$build/bin/dnallm-eval" --model "$run/checkpoints/best" --table "$task/test.csv" >"$run/test.json"
  echo "seed $s: $(cat "$run/test.json")"
done
# Mean and sample standard deviation of each score over the seeds (flat JSON from dnallm-eval).
seeds_csv=$(IFS=,; echo "${seed_list[*]}")
awk -v seeds="$seeds_csv" -v task="$task" '
  function num(line, key) {
    if (!match(line, "\"" key "\":[-0-9.eE+]+")) return "nan"
    return substr(line, RSTART + length(key) + 3, RLENGTH - length(key) - 3)
  }
  { n++; for (i = 1; i <= 5; i++) { v[i, n] = num($0, k[i]) } }
  BEGIN { split("mcc f1 accuracy precision recall", k, " ") }
  END {
    printf "{\"task\":\"%s\",\"seeds\":[%s],\"runs\":%d", task, seeds, n
    for (i = 1; i <= 5; i++) {
      s = 0; for (j = 1; j <= n; j++) s += v[i, j]; mean = s / n
      q = 0; for (j = 1; j <= n; j++) q += (v[i, j] - mean) ^ 2
      sd = n > 1 ? sqrt(q / (n - 1)) : 0
      printf ",\"%s\":{\"mean\":%.6f,\"std\":%.6f}", k[i], mean, sd
    }
    print "}"
  }' $(for s in "${seed_list[@]}"; do echo "$out/seed$s/test.json"; done) >"$out/summary.json"
echo "summary: $(cat "$out/summary.json")"
