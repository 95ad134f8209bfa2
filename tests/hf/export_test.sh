#!/bin/sh
# CTest hf_check_export: every kind of Hugging Face export the C++ test writes, loaded by
# transformers' Auto classes and PEFT (tests/hf/check_export.py) against dnallm-eval.
#   export_test.sh PYTHON WORKER_HF_IMPORT_TEST DNALLM_EVAL
set -eu
python="$1" import_test="$2" eval_bin="$3"
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/dnallm_hf_exports.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
if ! DNALLM_HF_EXPORT_KEEP="$tmp/exports" "$import_test" --gtest_filter='Kinds/*' \
     > "$tmp/gtest.log" 2>&1; then
  cat "$tmp/gtest.log"
  echo "FAIL: $import_test --gtest_filter='Kinds/*' did not write the exports" >&2
  exit 1
fi
# Every kind the C++ test instantiates, none left out (an empty directory would pass nothing).
kinds="$(ls "$tmp/exports")"
[ -n "$kinds" ] || { echo "FAIL: no export written under $tmp/exports" >&2; exit 1; }
echo "exports:" $kinds
exec "$python" "$here/check_export.py" --eval "$eval_bin" "$tmp"/exports/*
