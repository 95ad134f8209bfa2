#!/bin/sh
# CTest hf_fixtures_regenerated: a fresh fixture set made by transformers now
# (tests/hf/make_fixtures.py), then our C++ import test against it instead of the committed set,
# and the families it re-exports loaded back by transformers (tests/hf/check_export.py).
#   regenerated_fixtures_test.sh PYTHON WORKER_HF_IMPORT_TEST DNALLM_EVAL
set -eu
python="$1" import_test="$2" eval_bin="$3"
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/dnallm_hf_fixtures.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
"$python" "$here/make_fixtures.py" --out "$tmp/fixtures"
# Every test that reads the fixtures (our own export kinds only take their sequences).
DNALLM_HF_FIXTURES_DIR="$tmp/fixtures" DNALLM_HF_EXPORT_KEEP="$tmp/exports" \
  "$import_test" --gtest_filter='-Kinds/HfExportTest.*'
exec "$python" "$here/check_export.py" --eval "$eval_bin" "$tmp"/exports/*
