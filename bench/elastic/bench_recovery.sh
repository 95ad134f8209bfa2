#!/usr/bin/env bash
# bench/elastic: recovery time of an elastic job after a worker is SIGKILLed, median of 5
# kills with real dnallm-train workers (dnallm-launch --standalone, 2 ranks, Gloo), against
# torchrun with 2 PyTorch DDP workers resuming from torch.save, measured in the same run.
# From the kill to the first completed step of the restarted group; printed beside the 5 s
# target and as ours / torchrun. See recovery.py for the protocol.
#
#   bench/elastic/bench_recovery.sh [build-dir]      env: KILLS (5), PYTHON (/usr/bin/python3),
#                                                    NO_PEER=1 to skip torchrun
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
PYTHON=${PYTHON:-/usr/bin/python3}
args=(--launch "$BUILD/bin/dnallm-launch" --kills "${KILLS:-5}" --python "$PYTHON")
[ -n "${NO_PEER:-}" ] && args+=(--no-peer)
exec "$PYTHON" bench/elastic/recovery.py "${args[@]}"
