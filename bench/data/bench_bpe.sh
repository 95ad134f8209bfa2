#!/usr/bin/env bash
# bench/data: BPE encode throughput, ours vs the tokenizers library (bench_bpe.py says how).
#   bench/data/bench_bpe.sh [build dir]     (needs the hf_tokenize_tool target built)
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/python-env.sh
BUILD=${1:-build}
exec "$DNALLM_PYTHON" bench/data/bench_bpe.py --tool "$BUILD/tests/hf/hf_tokenize_tool" --source-dir .
