#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine: install what is missing, build, run ctest.
#   scripts/test.sh              everything, two tests at a time (DNALLM_TEST_JOBS, default 2)
#   scripts/test.sh -R Config    only tests matching a regex (any ctest arguments)
#   scripts/test.sh -L quick     the cheap tests only (a session's inner loop, docs/build.md)
# It ends by printing where the time went: install, build and tests, the slowest build steps
# (scripts/build-times.py build) and the slowest tests.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
t0=$(date +%s)
# The modules without LibTorch compile while PyTorch downloads (scripts/setup.sh).
"$root/scripts/setup.sh"
t1=$(date +%s)
"$root/scripts/check-format.sh"
"$root/scripts/build.sh"
t2=$(date +%s)
# Note [Parallel suite]: two tests at a time on 2 cores. The tests that time failures (a killed
# rank named within a timeout, a hang detected, SIGUSR1 to a checkpoint) or start many processes
# are RUN_SERIAL (dnallm_test's SERIAL, tests/CMakeLists.txt): ctest runs each with nothing
# beside it, so their timing is what it was when the suite ran one test at a time.
out="$build/Testing/ctest-output.txt"
mkdir -p "$build/Testing"
rc=0
ctest --test-dir "$build" --output-on-failure --timeout 600 -j "${DNALLM_TEST_JOBS:-2}" "$@" \
  2>&1 | tee "$out" || rc=$?
t3=$(date +%s)
python="$(command -v python3 || true)"
if [ -n "$python" ]; then
  echo
  "$python" "$root/scripts/build-times.py" tests "$out" --top 25 || true
  echo
  "$python" "$root/scripts/build-times.py" build "$build" --top 25 | sed -n '1,30p' || true
fi
echo
echo "test.sh: install (and the modules without LibTorch beside it) $((t1 - t0)) s, format check" \
     "and build $((t2 - t1)) s, tests $((t3 - t2)) s;" \
     "total $((t3 - t0)) s"
exit "$rc"
