#!/usr/bin/env bash
# Configure (once) and build incrementally into build/ (or $DNALLM_BUILD_DIR). Used by
# quickstart.sh and test.sh; safe to run directly.
#
#   scripts/build.sh [--target NAME]... [--no-tests] [--no-bench] [--cuda] [--deps PREFIX]
#                    [--libtorch PATH] [--no-torch]
#
# One LibTorch, the one inside PyTorch 2.x (minimum torch 2.4): the project's Python
# environment's (scripts/install-deps.sh makes it), else python3's (a GPU node's wheel), or
# --libtorch PATH / $LIBTORCH (a libtorch folder or its share/cmake). A CUDA-enabled LibTorch
# (pip's wheels are) with the CUDA toolkit (nvcc on PATH or /usr/local/cuda) builds the CUDA
# flavour: the same binaries run on a CPU-only machine. NCCL comes from the nvidia-nccl wheel
# beside torch, else the system's. The programs link LibTorch's CPU half only; its CUDA half
# and NCCL go into bin/libdnallm_cuda.so, loaded for GPU runs (Note [Lazy CUDA], docs/gpu.md).
#   --cuda         build into build-cuda/ (or $DNALLM_BUILD_DIR) and fail unless the build has
#                  CUDA (GPU nodes: docs/gpu.md)
#   --deps PREFIX  the folder made by scripts/stage-gpu-deps.sh (htslib, TOML++, xxHash,
#                  GoogleTest, Gloo) on a machine without apt
#   --target NAME  build only the named targets (repeatable)
#   --no-tests / --no-bench   leave the test suite / benchmarks out
#   --no-torch     only the modules without LibTorch, before PyTorch is installed (Note [Build
#                  without LibTorch], CMakeLists.txt; scripts/setup.sh); a later build.sh
#                  configures the same directory again with LibTorch and keeps their objects
# Binaries carry an RPATH to LibTorch, NCCL and the staged prefix: they run without
# LD_LIBRARY_PATH. With ccache installed, compiles go through it (shared by every clone).
# DNALLM_CMAKE_ARGS adds configure arguments.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=python-env.sh
. "$root/scripts/python-env.sh"
need_cuda=0
deps="${DNALLM_GPU_DEPS:-}"
libtorch="${LIBTORCH:-}"
tests=ON
bench=ON
torch=ON
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) need_cuda=1; shift ;;
    --deps) deps="$2"; shift 2 ;;
    --libtorch) libtorch="$2"; shift 2 ;;
    --target) targets+=(--target "$2"); shift 2 ;;
    --no-tests) tests=OFF; shift ;;
    --no-bench) bench=OFF; shift ;;
    --no-torch) torch=OFF; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$need_cuda" = 1 ]; then
  build="${DNALLM_BUILD_DIR:-$root/build-cuda}"
else
  build="${DNALLM_BUILD_DIR:-$root/build}"
fi
jobs="${DNALLM_JOBS:-$(nproc)}"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
python="$DNALLM_PYTHON"
[ -x "$python" ] || python="${PYTHON:-python3}"

prefix_path=""
rpath=""
nccl_root=""
# LibTorch's CMake folder, its lib/ and NCCL's wheel: prefix_path, rpath and nccl_root.
find_libtorch() {
  if [ -z "$libtorch" ]; then
    libtorch="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)" || {
      echo "build.sh: no LibTorch: $python cannot import torch. Run scripts/install-deps.sh (it" \
           "installs PyTorch $DNALLM_MIN_TORCH+ from requirements.txt), or pass --libtorch PATH" >&2
      exit 2
    }
  fi
  [ -d "$libtorch/share/cmake/Torch" ] && libtorch="$libtorch/share/cmake"
  [ -d "$libtorch/Torch" ] || {
    echo "build.sh: $libtorch holds no Torch/TorchConfig.cmake (pass a libtorch folder or" \
         "torch.utils.cmake_prefix_path)" >&2
    exit 2
  }
  local torch_lib
  torch_lib="$(cd "$libtorch/../../lib" 2>/dev/null && pwd)" &&
    { [ -e "$torch_lib/libtorch.so" ] || [ -e "$torch_lib/libtorch_cpu.so" ]; } || {
    echo "build.sh: no libtorch.so next to $libtorch" >&2
    exit 2
  }
  prefix_path="$libtorch"
  rpath="$torch_lib"
  if nccl_root="$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)" &&
     [ -f "$nccl_root/include/nccl.h" ]; then
    rpath="$rpath;$nccl_root/lib"
  else
    nccl_root=""  # FindNCCL looks in /usr and the CUDA toolkit
  fi
}
[ "$torch" = OFF ] || find_libtorch
if [ -n "$deps" ]; then
  deps="$(cd "$deps" && pwd)"
  [ -d "$deps/lib/pkgconfig" ] || {
    echo "build.sh: --deps $deps is not a prefix made by scripts/stage-gpu-deps.sh" \
         "(no lib/pkgconfig)" >&2
    exit 2
  }
  prefix_path="$deps${prefix_path:+;$prefix_path}"
  rpath="$deps/lib${rpath:+;$rpath}"
  export PKG_CONFIG_PATH="$deps/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
fi
if [ "$tests" = ON ] && [ ! -f "${deps:-/nonexistent}/lib/libgtest.a" ] &&
   [ ! -f /usr/lib/x86_64-linux-gnu/libgtest.a ] && [ ! -f /usr/lib/libgtest.a ]; then
  echo "build.sh: no GoogleTest (scripts/install-deps.sh, or stage it with" \
       "scripts/stage-gpu-deps.sh): tests off" >&2
  tests=OFF
fi
if [ "$bench" = ON ] && [ ! -f /usr/lib/x86_64-linux-gnu/libbenchmark.a ] &&
   [ ! -f /usr/lib/x86_64-linux-gnu/libbenchmark.so ]; then
  bench=OFF
fi
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  # Paths under the clone are hashed relative to it: another clone (CI's) hits the same cache.
  export CCACHE_BASEDIR="$root"
  export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
  export CCACHE_NOHASHDIR=1
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
python_arg=()
[ "$torch" = OFF ] || python_arg=(-DPython3_EXECUTABLE="$python")
# A build directory configured --no-torch is configured again with LibTorch (the same command).
if [ ! -f "$build/CMakeCache.txt" ] ||
   { [ "$torch" = ON ] && grep -q '^DNALLM_WITH_TORCH:BOOL=OFF' "$build/CMakeCache.txt"; }; then
  # DT_RPATH (--disable-new-dtags), not DT_RUNPATH: it also serves the libraries' own
  # dependencies (libhts -> libhtscodecs, libgloo -> libhiredis in the staged prefix).
  cmake -S "$root" -B "$build" "${generator[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE="${DNALLM_BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$prefix_path" \
    "${python_arg[@]}" \
    ${nccl_root:+-DNCCL_ROOT="$nccl_root"} \
    -DCMAKE_BUILD_RPATH="$rpath" \
    -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags" \
    -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--disable-new-dtags" \
    -DDNALLM_BUILD_TESTS="$tests" -DDNALLM_BUILD_BENCH="$bench" -DDNALLM_WITH_TORCH="$torch" \
    ${DNALLM_CMAKE_ARGS:-}
fi
if [ "$need_cuda" = 1 ] && ! grep -q '^DNALLM_TORCH_CUDA_FOUND:INTERNAL=ON' "$build/CMakeCache.txt"; then
  echo "build.sh --cuda: this build has no CUDA: the LibTorch in $libtorch is CPU-only or" \
       "the CUDA toolkit was not found (see the configuration summary above)" >&2
  exit 2
fi
cmake --build "$build" --parallel "$jobs" "${targets[@]}"
if [ "$need_cuda" = 1 ]; then
  echo
  echo "built into $build/bin (RPATH: $rpath)"
  echo "other programs that load these libraries need:"
  echo "  export LD_LIBRARY_PATH=${rpath//;/:}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
fi
