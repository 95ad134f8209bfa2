# Sourced by the bench/ scripts after `cd` to the repository root: what their starts share.
#   bench_start "$@"  the peers' interpreters (bench/python.sh: --python PATH..., PYTHONS,
#                     PYTHON), then BUILD: the first other argument, else build
#   bench_tmp         TMP: a temporary folder, removed when the script exits
#   bench_timed FILE CMD...   runs CMD and writes its start and end (date +%s.%N) to FILE
#   bench_summary ARGS... <<'PY'   runs the summary's Python (stdin) with PYTHON and ARGS, with
#                     bench/summary.py importable (what the summaries share)
# shellcheck shell=bash
# shellcheck source=python.sh
. bench/python.sh
# shellcheck disable=SC2034  # BUILD is the calling script's
bench_start() {
  bench_parse_args "$@"
  BUILD=${ARGS[0]:-build}
}
bench_tmp() {
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
}
bench_timed() {
  local file=$1 start
  shift
  start=$(date +%s.%N)
  "$@"
  echo "$start $(date +%s.%N)" > "$file"
}
bench_summary() {
  PYTHONPATH="bench${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$@"
}
