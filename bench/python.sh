# Sourced by the bench/ scripts (after `cd` to the repository root): PYTHON, the interpreter
# that runs the PyTorch peers and the summaries. Order: `--python PATH` (bench_python_arg
# takes it out of the arguments), else $PYTHON, else the project's $DNALLM_PYTHON
# (scripts/python-env.sh: the venv whose torch dnallm-train links). The same script runs the
# peer on another torch with, e.g., --python ~/.local/share/dnallm-dist/venv-215/bin/python.
# shellcheck shell=bash
# shellcheck source=../scripts/python-env.sh
. scripts/python-env.sh
PYTHON=${PYTHON:-$DNALLM_PYTHON}
# bench_python_check: fails with a message unless $PYTHON imports torch; prints its version.
bench_python_check() {
  PEER_TORCH=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) || {
    echo "$(basename "$0"): $PYTHON cannot import torch (scripts/install-deps.sh makes" \
         "$DNALLM_VENV; --python PATH or PYTHON=PATH picks another)" >&2
    exit 2
  }
  export PEER_TORCH
}
