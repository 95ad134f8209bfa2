#!/usr/bin/env bash
# Configure (once) and build incrementally into build/ (or $DNALLM_BUILD_DIR).
# Used by quickstart.sh and test.sh; safe to run directly.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
jobs="${DNALLM_JOBS:-$(nproc)}"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE="${DNALLM_BUILD_TYPE:-Release}"
fi
cmake --build "$build" --parallel "$jobs"
