#!/usr/bin/env bash
# Builds tests/fuzz/untrusted_readers_fuzz.cpp with clang's libFuzzer (Debian's clang-14:
# clang++-14 -fsanitize=fuzzer,address,undefined) and runs it for a bounded time from the
# seed corpus beside it. The readers under test are compiled here with instrumentation; the
# rest links from the CMake build's static libraries (their unity batches may pull in the
# config reader: hence tomlplusplus; the two readers compiled here are kept out of the batches,
# core/ and checkpoint/CMakeLists.txt).
#   tests/fuzz/run-fuzz.sh BUILD_DIR [SECONDS]     (ctest: fuzz_untrusted_readers, 20 s)
# Exit 0: no finding; 1: a finding (the crashing input is left in BUILD_DIR/fuzz/);
# 77: skipped (no clang++-14), which ctest reports as skipped.
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
build="$(cd "$1" && pwd)"
seconds="${2:-20}"
cxx="${DNALLM_FUZZ_CXX:-clang++-14}"
if ! command -v "$cxx" >/dev/null; then
  echo "fuzz: $cxx not found: skipped (Debian: apt-get install clang-14)"; exit 77
fi
out="$build/fuzz"
mkdir -p "$out/corpus"
bin="$out/untrusted_readers_fuzz"
sources=("$src/tests/fuzz/untrusted_readers_fuzz.cpp" "$src/core/untrusted_file.cpp"
         "$src/checkpoint/safetensors.cpp" "$src/worker/data/hf_tokenizer.cpp"
         "$src/worker/data/hf_bpe.cpp")
stale=0
[ -x "$bin" ] || stale=1
for f in "${sources[@]}" "$build/checkpoint/libdnallm_checkpoint.a" "$build/core/libdnallm_core.a"; do
  [ "$f" -nt "$bin" ] && stale=1
done
if [ "$stale" = 1 ]; then
  echo "fuzz: building $bin"
  "$cxx" -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$src" -DDNALLM_VERSION='"fuzz"' "${sources[@]}" \
    "$build/checkpoint/libdnallm_checkpoint.a" "$build/core/libdnallm_core.a" \
    $(pkg-config --libs libzstd libxxhash tomlplusplus 2>/dev/null || echo -lzstd -lxxhash -ltomlplusplus) \
    -lfmt -lspdlog -lpthread -o "$bin.tmp"
  mv "$bin.tmp" "$bin"
fi
cp -n "$src"/tests/fuzz/corpus/* "$out/corpus/" 2>/dev/null || true
cd "$out"
echo "fuzz: running for ${seconds}s"
exec "$bin" -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=1024 -timeout=10 \
  -print_final_stats=1 "$out/corpus"
