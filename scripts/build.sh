#!/usr/bin/env bash
# Configure (once) and build incrementally into build/ (or $DNALLM_BUILD_DIR).
# Used by quickstart.sh and test.sh; safe to run directly.
#
# GPU nodes (docs/gpu.md): scripts/build.sh --cuda [--deps PREFIX] [--libtorch PATH]
#                          [--target NAME]... [--no-tests]
#   Builds the CUDA flavour into build-cuda/ (or $DNALLM_BUILD_DIR) against a LibTorch 2.x:
#   --libtorch PATH (or $LIBTORCH; a libtorch folder or its share/cmake), else the one of
#   `python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'`. NCCL from the
#   nvidia-nccl wheel when python3 has it, else the system's (/usr). --deps PREFIX is the
#   folder made by scripts/stage-gpu-deps.sh (htslib, TOML++, xxHash, GoogleTest, Gloo).
#   Binaries carry an RPATH to all of these: they run without LD_LIBRARY_PATH.
#   --target limits the build to the named targets (repeatable); tests build when
#   GoogleTest is found, unless --no-tests. DNALLM_CMAKE_ARGS adds configure arguments
#   (e.g. "-DDNALLM_WITH_MPI=OFF" where MPI's libraries are there but not its headers).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cuda=0
deps="${DNALLM_GPU_DEPS:-}"
libtorch="${LIBTORCH:-}"
tests=ON
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=1; shift ;;
    --deps) deps="$2"; shift 2 ;;
    --libtorch) libtorch="$2"; shift 2 ;;
    --target) targets+=(--target "$2"); shift 2 ;;
    --no-tests) tests=OFF; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$cuda" = 1 ]; then
  build="${DNALLM_BUILD_DIR:-$root/build-cuda}"
else
  build="${DNALLM_BUILD_DIR:-$root/build}"
fi
jobs="${DNALLM_JOBS:-$(nproc)}"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

if [ "$cuda" = 0 ]; then
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE="${DNALLM_BUILD_TYPE:-Release}"
  fi
  cmake --build "$build" --parallel "$jobs" "${targets[@]}"
  exit 0
fi

# --- CUDA flavour ---
python="${PYTHON:-python3}"
if [ -z "$libtorch" ]; then
  libtorch="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)" || {
    echo "build.sh --cuda: no LibTorch: python3 cannot import torch; pass --libtorch PATH or" \
         "set LIBTORCH to a libtorch folder" >&2
    exit 2
  }
fi
[ -d "$libtorch/share/cmake/Torch" ] && libtorch="$libtorch/share/cmake"
[ -d "$libtorch/Torch" ] || {
  echo "build.sh --cuda: $libtorch holds no Torch/TorchConfig.cmake (pass a libtorch folder or" \
       "torch.utils.cmake_prefix_path)" >&2
  exit 2
}
torch_lib=""
for d in "$libtorch/../../lib" "$libtorch/.."; do  # a wheel or libtorch; Debian's layout
  if [ -e "$d/libtorch.so" ] || [ -e "$d/libtorch_cpu.so" ]; then torch_lib="$(cd "$d" && pwd)"; break; fi
done
[ -n "$torch_lib" ] || { echo "build.sh --cuda: no libtorch.so next to $libtorch" >&2; exit 2; }
prefix_path="$libtorch"
rpath="$torch_lib"
nccl_root=""
if nccl_root="$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)" &&
   [ -f "$nccl_root/include/nccl.h" ]; then
  rpath="$rpath;$nccl_root/lib"
else
  nccl_root=""  # FindNCCL looks in /usr and the CUDA toolkit
fi
if [ -n "$deps" ]; then
  deps="$(cd "$deps" && pwd)"
  [ -d "$deps/lib/pkgconfig" ] || {
    echo "build.sh --cuda: --deps $deps is not a prefix made by scripts/stage-gpu-deps.sh" \
         "(no lib/pkgconfig)" >&2
    exit 2
  }
  prefix_path="$deps;$prefix_path"
  rpath="$deps/lib;$rpath"
  export PKG_CONFIG_PATH="$deps/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
fi
if [ "$tests" = ON ] && [ ! -f "${deps:-/nonexistent}/lib/libgtest.a" ] &&
   [ ! -f /usr/lib/x86_64-linux-gnu/libgtest.a ] && [ ! -f /usr/lib/libgtest.a ]; then
  echo "build.sh --cuda: no GoogleTest (stage it with scripts/stage-gpu-deps.sh): tests off" >&2
  tests=OFF
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  # DT_RPATH (--disable-new-dtags), not DT_RUNPATH: it also serves the libraries' own
  # dependencies (libhts -> libhtscodecs, libgloo -> libhiredis in the staged prefix).
  cmake -S "$root" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE="${DNALLM_BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$prefix_path" \
    ${nccl_root:+-DNCCL_ROOT="$nccl_root"} \
    -DCMAKE_BUILD_RPATH="$rpath" \
    -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags" \
    -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--disable-new-dtags" \
    -DDNALLM_BUILD_TESTS="$tests" -DDNALLM_BUILD_BENCH=OFF ${DNALLM_CMAKE_ARGS:-}
fi
grep -q '^DNALLM_TORCH_CUDA_FOUND:INTERNAL=ON' "$build/CMakeCache.txt" 2>/dev/null ||
  echo "build.sh --cuda: warning: CMake found a LibTorch without CUDA (see the configuration" \
       "summary above)" >&2
cmake --build "$build" --parallel "$jobs" "${targets[@]}"
echo
echo "built into $build/bin (RPATH: $rpath)"
echo "other programs that load these libraries need:"
echo "  export LD_LIBRARY_PATH=${rpath//;/:}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
