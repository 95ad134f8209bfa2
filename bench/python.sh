# Sourced by the bench/ scripts (after `cd` to the repository root): the interpreters that run
# the PyTorch peers. PYTHONS (an array): every `--python PATH` given (bench_python_arg takes
# them out of the arguments; several run one after the other in the same rounds, e.g. torch
# 2.14.1 and 2.15.0 side by side), else $PYTHON, else the project's $DNALLM_PYTHON
# (scripts/python-env.sh: the venv whose torch dnallm-train links). PYTHON is the first; it
# also runs the summaries.
#   bench/train/bench_train.sh --python "$DNALLM_PYTHON" --python ~/.local/share/dnallm-dist/venv-215/bin/python
# shellcheck shell=bash
# shellcheck source=../scripts/python-env.sh
. scripts/python-env.sh
PYTHONS=()
# bench_parse_args "$@": sets PYTHONS and PYTHON, leaves the other arguments in ARGS.
bench_parse_args() {
  ARGS=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --python) PYTHONS+=("$2"); shift 2 ;;
      --python=*) PYTHONS+=("${1#*=}"); shift ;;
      *) ARGS+=("$1"); shift ;;
    esac
  done
  [ ${#PYTHONS[@]} -gt 0 ] || PYTHONS=("${PYTHON:-$DNALLM_PYTHON}")
  PYTHON=${PYTHONS[0]}
  local py version
  PEER_TORCHES=()
  for py in "${PYTHONS[@]}"; do
    version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null) || {
      echo "$(basename "$0"): $py cannot import torch (scripts/install-deps.sh makes" \
           "$DNALLM_VENV; --python PATH or PYTHON=PATH picks another)" >&2
      exit 2
    }
    PEER_TORCHES+=("$version")
  done
}
# bench_describe_peers: one line naming each peer interpreter and its torch.
bench_describe_peers() {
  local i
  for i in "${!PYTHONS[@]}"; do echo "  peer $i: ${PYTHONS[$i]} (torch ${PEER_TORCHES[$i]})"; done
}
