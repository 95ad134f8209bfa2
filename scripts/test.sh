#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine: install what is missing, build, run ctest.
#   scripts/test.sh              everything
#   scripts/test.sh -R Config    only tests matching a regex (any ctest arguments)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${DNALLM_BUILD_DIR:-$root/build}"
"$root/scripts/install-deps.sh"
"$root/scripts/check-format.sh"
"$root/scripts/build.sh"
# Multi-process tests start several processes each: on 2 cores running ctest tests in
# parallel makes timing-sensitive failure tests flaky, so they run one at a time.
ctest --test-dir "$build" --output-on-failure --timeout 600 "$@"
