#!/usr/bin/env bash
# Install the Debian packages dnallm-dist needs, and only those that are missing.
# Idempotent: a second run installs nothing. Runs as root, or through sudo.
#
#   scripts/install-deps.sh            build + runtime + test dependencies
#   scripts/install-deps.sh --bench    also the peers used by bench/ (python3-torch)
set -euo pipefail

build_pkgs=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libtorch-dev libopenblas0-openmp
  libopenmpi-dev openmpi-bin
  libgloo-dev libboost-dev libtomlplusplus-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libzstd-dev libxxhash-dev libhts-dev libsentencepiece-dev
  libcli11-dev libspdlog-dev nlohmann-json3-dev
)
# Used by the integration tests: a real one-node Slurm cluster and network namespaces
# (python3: a test compiles tests/hf/check_export.py, the transformers-side export check;
# clang-format: scripts/check-format.sh, run by scripts/test.sh).
test_pkgs=(slurm-wlm munge iproute2 procps python3 clang-format)
bench_pkgs=(python3-torch python3-numpy)

want=("${build_pkgs[@]}" "${test_pkgs[@]}")
for arg in "$@"; do
  case "$arg" in
    --bench) want+=("${bench_pkgs[@]}") ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "install-deps.sh: unknown option '$arg' (use --bench or --help)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${want[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#want[@]} packages present"
  exit 0
fi

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then sudo_cmd=(sudo); else
    echo "install-deps: missing packages (${missing[*]}) and not root; run as root or install sudo" >&2
    exit 2
  fi
fi

echo "install-deps: installing ${#missing[@]} missing package(s): ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
