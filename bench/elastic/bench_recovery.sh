#!/usr/bin/env bash
# bench/elastic: recovery time of an elastic job after a worker is SIGKILLed, median of 5
# kills with real dnallm-train workers (dnallm-launch --standalone, 2 ranks, Gloo), against
# torchrun with 2 PyTorch DDP workers resuming from torch.save, measured in the same run.
# From the kill to the first completed step of the restarted group; printed beside the 5 s
# target and as ours / torchrun. See recovery.py for the protocol.
#
#   bench/elastic/bench_recovery.sh [--python PATH] [build-dir]
#   env: KILLS (5), PYTHON ($DNALLM_PYTHON: torchrun's torch), NO_PEER=1 to skip torchrun
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
bench_start "$@"
echo "bench/elastic: ours $BUILD/bin/dnallm-launch; torchrun from $PYTHON (torch ${PEER_TORCHES[0]})"
args=(--launch "$BUILD/bin/dnallm-launch" --kills "${KILLS:-5}" --python "$PYTHON")
[ -n "${NO_PEER:-}" ] && args+=(--no-peer)
exec "$PYTHON" bench/elastic/recovery.py "${args[@]}"
