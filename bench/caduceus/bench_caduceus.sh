#!/usr/bin/env bash
# Caduceus forward + backward tokens/s on the CPU: dnallm-bench-caduceus (Note [Fused selective
# scan]) against the reference (kuleshov-group's code over mamba-ssm's pure-PyTorch scan,
# bench/caduceus/caduceus_peer.py) with the same shape, batch, length, loss and threads, measured
# in this run under each torch given (the project's venv and, when present, $DNALLM_VENV-215).
# The reference code is not ours and not committed: --code and --mamba as
# tests/hf/make_caduceus_fixtures.py describes.
#   bench/caduceus/bench_caduceus.sh --code DIR --mamba DIR [--seq 4096] [--layers 4]
#                                    [--d-model 128] [--steps 2] [--rcps]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
source "$root/scripts/python-env.sh"
code="" mamba="" args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --code) code="$2"; shift 2 ;;
    --mamba) mamba="$2"; shift 2 ;;
    --rcps) args+=(--rcps); shift ;;
    --seq|--layers|--d-model|--d-state|--steps|--warmup|--batch) args+=("$1" "$2"); shift 2 ;;
    *) echo "bench_caduceus.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -n "$code" && -n "$mamba" ]] || { echo "bench_caduceus.sh: --code DIR and --mamba DIR are required" >&2; exit 2; }
ours=$("$build/bin/dnallm-bench-caduceus" "${args[@]}")
echo "$ours"
tps() { sed -n 's/.*"tokens_per_s": *\([0-9.e+-]*\).*/\1/p' <<<"$1"; }
pythons=("$DNALLM_PYTHON")
[[ -x "${DNALLM_VENV}-215/bin/python" ]] && pythons+=("${DNALLM_VENV}-215/bin/python")
for py in "${pythons[@]}"; do
  peer=$("$py" "$root/bench/caduceus/caduceus_peer.py" --code "$code" --mamba "$mamba" "${args[@]}" 2>/dev/null | tail -1)
  echo "$peer"
  awk -v a="$(tps "$ours")" -v b="$(tps "$peer")" -v py="$py" \
    'BEGIN { printf "ratio (dnallm / reference under %s): %.2fx\n", py, a / b }'
done
