#!/usr/bin/env bash
# Peak memory of refusals (issue 22: "peak memory of each refusal under 200 MB, measured"): a
# worker program that exits 2, 3 or 5 on bad input (a bad flag, a bad configuration key, a
# damaged model directory, an output that is an input, ...). Each case runs under
# /usr/bin/time -f %M (max RSS) RUNS times (median printed), with the binaries of BIN_DIR and,
# when given, of PEER_BIN_DIR (e.g. the pre-Note [Lazy CUDA] binaries) on the same inputs:
#
#   case                              exit   ours_MB   peer_MB   ours/peer
#
# The tiny model the cases damage is trained by BIN_DIR's dnallm-train (2 steps, CPU). Exits 1
# when a case exits 0, or with another code than the peer's.
#
#   bench/refusal_memory.sh [BIN_DIR [PEER_BIN_DIR]]     (default build/bin, no peer)
#   env: RUNS (3), LIMIT_MB (200: cases above it are marked "over")
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(cd "${1:-build/bin}" && pwd)
PEER=""
[ $# -ge 2 ] && PEER=$(cd "$2" && pwd)
RUNS=${RUNS:-3}
LIMIT_MB=${LIMIT_MB:-200}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
[ -x /usr/bin/time ] || { echo "refusal_memory.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 2; }

tiny=(--set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64
      --set model.max_seq_length=64 --set training.micro_batch_size=4 --set training.max_steps=2
      --set checkpoint.save_steps=0 --set training.eval_steps=0 --set training.device=cpu
      --log-level error)
"$BIN/dnallm-train" --config configs/gpt.toml "${tiny[@]}" --set checkpoint.dir="$TMP/ck" >/dev/null
M="$TMP/ck/final"
bases=$(printf 'ACGTTGCA%.0s' $(seq 60))
printf '>a\n%s\n>b\n%s\n' "$bases" "${bases:7}" > "$TMP/in.fa"
printf 'sequence\nACGTAC\nGGCCTA\n' > "$TMP/in.csv"
sed 's|^train_files = .*|train_files = ["'"$TMP"'/nowhere.fa"]|' configs/gpt.toml > "$TMP/nodata.toml"
# Damaged copies of the model.
"${DNALLM_PYTHON:-python3}" - "$M" "$TMP" <<'EOF'
import json, shutil, struct, sys
model, tmp = sys.argv[1], sys.argv[2]
def copy(name):
    shutil.copytree(model, f"{tmp}/{name}")
    return f"{tmp}/{name}"
d = copy("heads0")
c = json.load(open(f"{d}/config.json")); c["num_attention_heads"] = 0
json.dump(c, open(f"{d}/config.json", "w"))
d = copy("header")  # the safetensors header claims 1 TB
raw = open(f"{d}/model.safetensors", "rb").read()
open(f"{d}/model.safetensors", "wb").write(struct.pack("<Q", 1 << 40) + raw[8:])
d = copy("truncated")  # the data section cut short
open(f"{d}/model.safetensors", "wb").write(raw[: len(raw) // 2])
d = copy("notokenizer")
import os; os.remove(f"{d}/tokenizer.json")
EOF

cases=()
add() { cases+=("$1"); }
# name|command line (the binary's name first; run from BIN_DIR or PEER_BIN_DIR)
add "train: unknown flag|dnallm-train --no-such-flag"
add "train: config file missing|dnallm-train --config $TMP/nowhere.toml"
add "train: unknown config key|dnallm-train --config configs/gpt.toml --set training.no_such_key=1"
add "train: bad training.device|dnallm-train --config configs/gpt.toml --set training.device=tpu"
add "train: bad training.lr|dnallm-train --config configs/gpt.toml --set training.lr=-1"
add "train: data file missing|dnallm-train --config $TMP/nodata.toml ${tiny[*]} --set checkpoint.dir=$TMP/ck2"
add "train: init_from bad header|dnallm-train --config configs/gpt.toml ${tiny[*]} --set model.init_from=$TMP/header --set checkpoint.dir=$TMP/ck3"
# Asked for CUDA where there is none: the plugin must load to let LibTorch say so.
add "train: device cuda, no GPU *|dnallm-train --config configs/gpt.toml ${tiny[*]} --set training.device=cuda --set checkpoint.dir=$TMP/ck4"
add "infer: unknown flag|dnallm-infer embed --no-such-flag"
add "infer: --out missing|dnallm-infer embed --model $M --input $TMP/in.fa"
add "infer: output is an input|dnallm-infer predict --model $M --input $TMP/in.csv --out $TMP/in.csv"
add "infer: --temperature nan|dnallm-infer generate --model $M --prompt ACGT --temperature nan"
add "infer: heads = 0|dnallm-infer embed --model $TMP/heads0 --input $TMP/in.fa --out $TMP/o.npy"
add "infer: safetensors header|dnallm-infer embed --model $TMP/header --input $TMP/in.fa --out $TMP/o.npy"
add "infer: safetensors truncated|dnallm-infer embed --model $TMP/truncated --input $TMP/in.fa --out $TMP/o.npy"
add "infer: no tokenizer.json|dnallm-infer embed --model $TMP/notokenizer --input $TMP/in.fa --out $TMP/o.npy"
add "infer: input missing|dnallm-infer embed --model $M --input $TMP/nowhere.fa --out $TMP/o.npy"
add "eval: unknown flag|dnallm-eval --no-such-flag"
add "eval: heads = 0|dnallm-eval --model $TMP/heads0 --fasta $TMP/in.fa"
add "eval: safetensors header|dnallm-eval --model $TMP/header --fasta $TMP/in.fa"
add "eval: input missing|dnallm-eval --model $M --fasta $TMP/nowhere.fa"

# measure DIR COMMAND: prints "EXIT MEDIAN_KB".
measure() {
  local dir=$1 argv kb=() code=0 i
  read -ra argv <<< "$2"  # no quoting needed: no path here holds a space
  for i in $(seq "$RUNS"); do
    /usr/bin/time -o "$TMP/time" -f '%x %M' "$dir/${argv[0]}" "${argv[@]:1}" >/dev/null 2>&1 || true
    code=$(cut -d' ' -f1 "$TMP/time" | tail -1)
    kb+=("$(tail -1 "$TMP/time" | cut -d' ' -f2)")
  done
  echo "$code $(printf '%s\n' "${kb[@]}" | sort -n | sed -n "$(( (RUNS + 1) / 2 ))p")"
}

echo "refusal peak memory (max RSS, median of $RUNS runs), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "  ours: $BIN"
[ -n "$PEER" ] && echo "  peer: $PEER"
printf '%-32s %5s %9s %9s %10s\n' case exit ours_MB peer_MB ours/peer
bad=0
over=0
for c in "${cases[@]}"; do
  name=${c%%|*} cmd=${c#*|}
  read -r code kb < <(measure "$BIN" "$cmd")
  mb=$(awk -v k="$kb" 'BEGIN { printf "%.1f", k / 1024 }')
  pmb="-" ratio="-" pcode=""
  if [ -n "$PEER" ]; then
    read -r pcode pkb < <(measure "$PEER" "$cmd")
    pmb=$(awk -v k="$pkb" 'BEGIN { printf "%.1f", k / 1024 }')
    ratio=$(awk -v a="$kb" -v b="$pkb" 'BEGIN { printf "%.3f", a / b }')
  fi
  note=""
  [ "$code" = 0 ] && { note=" (not refused!)"; bad=1; }
  [ -n "$pcode" ] && [ "$pcode" != "$code" ] && { note=" (peer exits $pcode)"; bad=1; }
  awk -v m="$mb" -v l="$LIMIT_MB" 'BEGIN { exit !(m > l) }' && { note="$note over ${LIMIT_MB} MB"; over=$((over + 1)); }
  printf '%-32s %5s %9s %9s %10s%s\n' "$name" "$code" "$mb" "$pmb" "$ratio" "$note"
done
echo "cases over ${LIMIT_MB} MB: $over of ${#cases[@]} (*: asks for CUDA, so loads the CUDA plugin by design)"
exit $bad
