#!/usr/bin/env bash
# HyenaDNA forward + backward tokens/s on the CPU: dnallm-bench-hyena against the reference
# (LongSafari's hub code, bench/hyena/hyena_peer.py) with the same shape, batch, length, loss
# and threads, measured in this run, once under each torch given (default: the project's venv
# and, when present, the torch 2.15 venv $DNALLM_VENV-215). The reference code is not ours and
# not committed: --code names a folder with modeling_hyena.py and configuration_hyena.py
# (see tests/hf/make_hyena_fixtures.py).
# Note [CPU allocator]: ours links tcmalloc; the reference runs twice under each torch, as users
# run it (glibc's malloc) and with the same tcmalloc preloaded (LD_PRELOAD), and both ratios are
# printed: the second is the one our kernels alone earn.
#   bench/hyena/bench_hyena.sh --code DIR [--seq 32768] [--layers 8] [--d-model 256]
#                              [--d-inner 1024] [--steps 2] [--checkpoint]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
source "$root/scripts/python-env.sh"
code="" args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --code) code="$2"; shift 2 ;;
    --checkpoint) args+=(--checkpoint); shift ;;
    --seq|--layers|--d-model|--d-inner|--steps|--warmup|--batch) args+=("$1" "$2"); shift 2 ;;
    *) echo "bench_hyena.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -n "$code" ]] || { echo "bench_hyena.sh: --code DIR (LongSafari's modeling_hyena.py) is required" >&2; exit 2; }
ours=$("$build/bin/dnallm-bench-hyena" "${args[@]}")
echo "$ours"
tps() { sed -n 's/.*"tokens_per_s": *\([0-9.e+-]*\).*/\1/p' <<<"$1"; }
pythons=("$DNALLM_PYTHON")
[[ -x "${DNALLM_VENV}-215/bin/python" ]] && pythons+=("${DNALLM_VENV}-215/bin/python")
tcmalloc=$(ldd "$build/bin/dnallm-bench-hyena" | awk '/libtcmalloc/ { print $3; exit }')
for py in "${pythons[@]}"; do
  for preload in "" "$tcmalloc"; do
    peer=$(LD_PRELOAD="$preload" "$py" "$root/bench/hyena/hyena_peer.py" --code "$code" \
      "${args[@]}" 2>/dev/null | tail -1)
    echo "$peer"
    awk -v a="$(tps "$ours")" -v b="$(tps "$peer")" -v py="$py" \
      -v alloc="${preload:+tcmalloc preloaded}" \
      'BEGIN { printf "ratio (dnallm / reference under %s, %s): %.2fx\n", py,
               alloc == "" ? "glibc malloc" : alloc, a / b }'
    [[ -n "$tcmalloc" ]] || break
  done
done
