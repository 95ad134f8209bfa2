#!/usr/bin/env bash
# bench/checkpoint: dnallm-bench-ckpt (our sharded, byte-grouped + zstd checkpoint files) vs
# torch.save/torch.load of the same tensors (torch_peer.py) in the same run, with the peer on
# the project's torch (dnallm-bench-ckpt's own default is /usr/bin/python3).
#
#   bench/checkpoint/bench_ckpt.sh [--python PATH]... [build-dir] [dnallm-bench-ckpt options...]
#   env: PYTHON ($DNALLM_PYTHON), ROUNDS (2: the whole bench runs ROUNDS times for each
#        --python, each run timing ours then the peer, --iters each after a warm-up)
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/python.sh
bench_parse_args "$@"
set -- "${ARGS[@]}"
BUILD=build
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then BUILD=$1; shift; fi
echo "bench/checkpoint: ours $BUILD/bin/dnallm-bench-ckpt, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
bench_describe_peers
for r in $(seq "${ROUNDS:-2}"); do
  for pi in "${!PYTHONS[@]}"; do
    echo "# round $r, peer torch ${PEER_TORCHES[$pi]}"
    "$BUILD/bin/dnallm-bench-ckpt" --python "${PYTHONS[$pi]}" "$@"
  done
done
