#!/usr/bin/env bash
# Peak memory and time of one forward + backward of the hyenadna-large shape (d_model 256,
# 8 layers, d_inner 1024, max_seq_len 1,048,576; batch 1) on the CPU at growing lengths, with
# activation checkpointing and Note [Hyena chunked block]: the measurements of
# docs/long-context.md. Each length runs in its own process (peak RSS is per process) and
# prints dnallm-bench-hyena --measure-memory's lines.
#   bench/hyena/long_context.sh [--lengths "8192 32768 131072 1048576"]
#                               [--chunk-positions 16384] [--chunk-channels 16] [--plain]
# --plain: checkpointing without chunking (the block recomputed whole), for comparison.
# After the runs, a prediction line a length of --predict from the last two lengths' slope (the
# per-token growth of the peak; a single run's bytes a token also counts fixed costs).
# OMP_WAIT_POLICY defaults to PASSIVE: on a machine shared with other work, OpenMP's spinning
# threads made a step 4-6x slower (90% of its samples in libgomp's barrier).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
lengths="8192 32768 131072 1048576" positions=16384 channels=16 plain=0 predict=1048576
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --lengths) lengths="$2"; shift 2 ;;
    --chunk-positions) positions="$2"; shift 2 ;;
    --chunk-channels) channels="$2"; shift 2 ;;
    --plain) plain=1; shift ;;
    --predict) predict="$2"; shift 2 ;;
    *) echo "long_context.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
chunks=(--chunk-positions "$positions" --chunk-channels "$channels")
[[ $plain == 1 ]] && chunks=()
peaks=()
for n in $lengths; do
  out=$("$build/bin/dnallm-bench-hyena" --measure-memory --seq "$n" --max-seq-len 1048576 \
    --d-model 256 --d-inner 1024 --layers 8 --checkpoint "${chunks[@]}" --predict "$n")
  line="${out%%$'\n'*}"
  echo "$line"
  peaks+=("$n $(sed -n 's/.*"peak_rss_mb": *\([0-9.e+-]*\).*/\1/p' <<<"$line")")
done
if [[ ${#peaks[@]} -ge 2 ]]; then
  read -r n1 p1 <<<"${peaks[-2]}"
  read -r n2 p2 <<<"${peaks[-1]}"
  awk -v n1="$n1" -v p1="$p1" -v n2="$n2" -v p2="$p2" -v want="$predict" 'BEGIN {
    slope = (p2 - p1) * 1048576 / (n2 - n1)
    printf "{\"prediction\":\"peak at %d + slope %d..%d\",\"bytes_per_token\":%.0f,\"seq\":%d,\"peak_rss_mb\":%.0f}\n",
      n2, n1, n2, slope, want, p2 + slope * (want - n2) / 1048576 }'
fi
