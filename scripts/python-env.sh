# Sourced by scripts/*.sh: where the project's Python environment lives (docs/install.md).
#   DNALLM_VENV    the virtual environment scripts/install-deps.sh makes once
#                  (default: ${XDG_DATA_HOME:-~/.local/share}/dnallm-dist/venv): it holds
#                  torch (whose LibTorch the build uses) and the test peers of requirements.txt
#   DNALLM_PYTHON  the interpreter every script and test uses: $DNALLM_VENV/bin/python
# shellcheck shell=bash
DNALLM_VENV="${DNALLM_VENV:-${XDG_DATA_HOME:-$HOME/.local/share}/dnallm-dist/venv}"
DNALLM_PYTHON="$DNALLM_VENV/bin/python"
# The oldest PyTorch whose LibTorch we build against (cmake/DnallmTorchVersion.cmake says why).
DNALLM_MIN_TORCH="2.4"
export DNALLM_VENV DNALLM_PYTHON DNALLM_MIN_TORCH

# Prints torch.utils.cmake_prefix_path of DNALLM_PYTHON, or fails with a message.
dnallm_torch_cmake_prefix() {
  "$DNALLM_PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || {
    echo "no LibTorch: $DNALLM_PYTHON cannot import torch; run scripts/install-deps.sh" >&2
    return 2
  }
}
