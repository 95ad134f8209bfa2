#!/usr/bin/env bash
# bench/data: BPE encode throughput, ours vs the tokenizers library (bench_bpe.py says how).
#   bench/data/bench_bpe.sh [build dir] [--dir TOKENIZER_DIR]   (needs target hf_tokenize_tool)
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/python-env.sh
BUILD=build
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then BUILD=$1; shift; fi
exec "$DNALLM_PYTHON" bench/data/bench_bpe.py --tool "$BUILD/tests/hf/hf_tokenize_tool" --source-dir . "$@"
