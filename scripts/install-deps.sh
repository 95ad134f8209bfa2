#!/usr/bin/env bash
# Install what dnallm-dist needs, and only what is missing. Idempotent: a second run installs
# nothing. Runs as root, or through sudo (for the Debian packages).
#
#   scripts/install-deps.sh            Debian packages (build, runtime, tests) and the Python
#                                      environment: torch (its LibTorch is what we build
#                                      against) and the test peers of requirements.txt
#   scripts/install-deps.sh --bench    also the benchmark peers (DNALLM, in its own venv)
#   scripts/install-deps.sh --debian   the Debian packages only
#
# The Python environment is one virtual environment, $DNALLM_VENV (default
# ~/.local/share/dnallm-dist/venv, shared by every clone). If the python3 on PATH already has
# torch >= 2.4 (a conda env, a venv, a GPU node's wheel), that torch is used and only the
# peers are installed beside it; DNALLM_OWN_TORCH=0 installs the pinned torch instead.
# The script says which it took. docs/install.md: sizes, times, and what each piece is for.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=python-env.sh
. "$root/scripts/python-env.sh"

build_pkgs=(
  build-essential cmake ninja-build pkg-config git ca-certificates ccache lld
  libopenblas0-openmp
  libopenmpi-dev openmpi-bin
  libgloo-dev libboost-dev libtomlplusplus-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libzstd-dev libxxhash-dev libhts-dev libsentencepiece-dev
  libcli11-dev libspdlog-dev nlohmann-json3-dev
  libgoogle-perftools-dev
  python3 python3-venv
)
# Used by the integration tests: a real one-node Slurm cluster and network namespaces
# (clang-format: scripts/check-format.sh, run by scripts/test.sh; clang-14 with libFuzzer: the
# fuzz target over the untrusted readers, tests/fuzz).
test_pkgs=(slurm-wlm munge iproute2 procps clang-format clang-14 libclang-rt-14-dev)
bench_pkgs=()

want=("${build_pkgs[@]}" "${test_pkgs[@]}")
bench=0
python_env=1
for arg in "$@"; do
  case "$arg" in
    --bench) bench=1; want+=("${bench_pkgs[@]}") ;;
    --debian) python_env=0 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "install-deps.sh: unknown option '$arg' (use --bench, --debian or --help)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${want[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

install_debian() {
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
  echo "install-deps: Debian packages installed"
}
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#want[@]} Debian packages present"
else
  install_debian
fi
[ "$python_env" = 1 ] || exit 0
"$root/scripts/python-deps.sh" $([ "$bench" = 1 ] && echo --bench)
