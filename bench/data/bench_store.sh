#!/usr/bin/env bash
# bench/data: start-up and memory of pre-training from a packed genome store against today's
# FASTA path (issue 52). For each size: a synthetic genome (bench/data/make_genome.py: 24 contigs,
# N runs, soft-masked runs, gzip), packed by dnallm-data (Mbases/s, bytes/base), then
# configs/quickstart.toml on W workers for 20 steps from the .fa.gz and from the store: time to
# the first step (launch to the first step's metrics line), the peak RSS of rank 0 (its
# summary's peak_rss_mb, the kernel's VmHWM: every rank reads the same data), and that peak split
# as the bench samples it every 20 ms from /proc/PID/status of every rank: `anon MB`, the
# largest RssAnon of a rank (memory the rank owns), and `file MB`, the largest RssFile (pages of
# mapped files: the store's are the page cache, one copy a node shared by every rank, which the
# kernel may drop and read again; the binaries and libraries too).
#   bench/data/bench_store.sh [BUILD] [--sizes "1e7 3e8"] [--workers "2"] [--files N]
#                             [--tmp DIR] [--skip-fasta-above BASES]
# Needs the targets dnallm-data, dnallm-train, dnallm-launch. The genomes and stores go to a
# temporary folder under --tmp (default $TMPDIR or /tmp), removed at the end: about 0.5 byte a
# base of disk at once.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/python-env.sh
BUILD=build
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then BUILD=$1; shift; fi
sizes="1e7 3e8"
workers="2"
files=1
tmp_root="${TMPDIR:-/tmp}"
skip_fasta_above=5e9
while [ $# -gt 0 ]; do
  case "$1" in
    --sizes) sizes=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --files) files=$2; shift 2 ;;
    --tmp) tmp_root=$2; shift 2 ;;
    --skip-fasta-above) skip_fasta_above=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "bench_store.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for exe in dnallm-data dnallm-train dnallm-launch; do
  [ -x "$BUILD/bin/$exe" ] || { echo "bench_store.sh: no $BUILD/bin/$exe; build it" >&2; exit 2; }
done
TMP=$(mktemp -d "$tmp_root/dnallm-bench-store.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
py=python3

# run_train NAME TRAIN_FILES WORKERS: prints "first_step_s peak_rss_mb anon_mb file_mb wall_s"
run_train() {
  local name=$1 train=$2 w=$3 dir="$TMP/run-$1"
  mkdir -p "$dir"
  local start first=""
  start=$(date +%s.%N)
  OMP_NUM_THREADS=1 "$BUILD/bin/dnallm-launch" --nproc-per-node "$w" -- "$BUILD/bin/dnallm-train" \
    --config configs/quickstart.toml --set "data.train_files=[\"$train\"]" \
    --set training.max_steps=20 --set training.logging_steps=1 --set parallel.backend=gloo \
    --set checkpoint.dir="$dir/ckpt" --set checkpoint.save_final=false \
    --metrics-file "$dir/metrics.jsonl" > "$dir/log" 2>&1 &
  local pid=$!
  local anon=0 file=0 p kb
  while kill -0 "$pid" 2>/dev/null; do
    if [ -z "$first" ] && grep -q '"step":1[,}]' "$dir/metrics.jsonl" 2>/dev/null; then
      first=$(date +%s.%N)
    fi
    for p in $(pgrep -f -- "--metrics-file $dir/metrics.jsonl" || true); do
      [ "$p" = "$pid" ] && continue
      kb=$(awk '/^RssAnon:/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
      [ -n "$kb" ] && [ "$kb" -gt "$anon" ] && anon=$kb
      kb=$(awk '/^RssFile:/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
      [ -n "$kb" ] && [ "$kb" -gt "$file" ] && file=$kb
    done
    sleep 0.02
  done
  wait "$pid" || { echo "bench_store.sh: $name failed:" >&2; tail -5 "$dir/log" >&2; return 1; }
  local end
  end=$(date +%s.%N)
  "$py" - "$dir/metrics.jsonl" "$start" "${first:-$end}" "$end" "$anon" "$file" <<'PY'
import json, sys
path, start, first, end, anon, file = sys.argv[1], *map(float, sys.argv[2:])
summary = [json.loads(l) for l in open(path) if '"summary"' in l][-1]
print(f"{first - start:.2f} {summary['peak_rss_mb']:.0f} {anon / 1024:.0f} {file / 1024:.0f} "
      f"{end - start:.2f}")
PY
}

row() { printf '%-10s %-7s %-7s %10s %10s %13s %12s %8s %8s %8s\n' "$@"; }
row bases workers path "pack Mb/s" bytes/base "first step s" "peak RSS MB" "anon MB" "file MB" \
  "wall s"
for size in $sizes; do
  genome="$TMP/genome-$size"
  if [ "$files" = 1 ]; then
    "$py" bench/data/make_genome.py --bases "$size" --out "$genome.fa.gz"
    inputs=("$genome.fa.gz")
    train_fasta="$genome.fa.gz"
  else
    mkdir -p "$genome"
    "$py" bench/data/make_genome.py --bases "$size" --files "$files" --out "$genome/g"
    inputs=("$genome")
    train_fasta="$genome"
  fi
  pack_line=$("$BUILD/bin/dnallm-data" pack "$TMP/store-$size" "${inputs[@]}" 2>"$TMP/pack.log" \
    | grep '^packed') || { cat "$TMP/pack.log" >&2; exit 1; }
  mbs=$(sed -E 's/.* ([0-9.]+) Mbases\/s.*/\1/' <<<"$pack_line")
  bpb=$(sed -E 's/.* ([0-9.]+) bytes\/base.*/\1/' <<<"$pack_line")
  for w in $workers; do
    for path in fasta store; do
      if [ "$path" = fasta ]; then
        if "$py" -c "import sys; sys.exit(0 if float('$size') > float('$skip_fasta_above') else 1)"; then
          row "$size" "$w" fasta - - skipped - - - -
          continue
        fi
        read -r first rss anon file wall < <(run_train "fasta-$size-$w" "$train_fasta" "$w")
        row "$size" "$w" fasta - - "$first" "$rss" "$anon" "$file" "$wall"
      else
        read -r first rss anon file wall < <(run_train "store-$size-$w" "$TMP/store-$size" "$w")
        row "$size" "$w" store "$mbs" "$bpb" "$first" "$rss" "$anon" "$file" "$wall"
      fi
    done
  done
  rm -rf "$genome" "$genome.fa.gz" "$TMP/store-$size" "$TMP"/run-*
done
