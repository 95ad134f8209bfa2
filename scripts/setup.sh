#!/usr/bin/env bash
# Install what is missing (scripts/install-deps.sh) and, while PyTorch's wheel downloads, compile
# the modules without LibTorch into the build directory (Note [Build without LibTorch],
# CMakeLists.txt): quickstart.sh and test.sh start here. On a fresh machine the download and
# those compiles overlap (about a minute and a half each on 2 cores); with an environment or a
# build directory already there it is install-deps.sh alone.
#   scripts/setup.sh [--target NAME]...   (the build directory: $DNALLM_BUILD_DIR, default build/)
# --target is build.sh's: the quickstart builds only `dnallm-libraries` here (what its programs
# link), the suite everything without LibTorch.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
"$root/scripts/install-deps.sh" --debian
if [ -f "$build/CMakeCache.txt" ]; then
  exec "$root/scripts/python-deps.sh"
fi
"$root/scripts/python-deps.sh" &
pip=$!
built=0
"$root/scripts/build.sh" --no-torch "$@" || built=$?
installed=0
wait "$pip" || installed=$?
[ "$installed" = 0 ] || exit "$installed"
exit "$built"
