#!/usr/bin/env bash
# The project's Python environment ($DNALLM_VENV, scripts/python-env.sh): torch, whose
# LibTorch the build uses, and the test peers pinned in requirements.txt. Called by
# scripts/install-deps.sh; idempotent (a stamp holds the hash of what was installed).
#   scripts/python-deps.sh           torch + test peers
#   scripts/python-deps.sh --bench   also DNALLM (the toolkit users come from) in $DNALLM_VENV-dnallm
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=python-env.sh
. "$root/scripts/python-env.sh"
bench=0
[ "${1:-}" = --bench ] && bench=1
req="$root/requirements.txt"
base_python="$(command -v python3 || true)"
[ -n "$base_python" ] || { echo "install-deps: no python3 on PATH (Debian: apt-get install python3 python3-venv)" >&2; exit 2; }

# Is there a usable torch already (the user's), outside our venv?
own_torch=""
if [ "${DNALLM_OWN_TORCH:-1}" != 0 ] && [ "$base_python" != "$DNALLM_PYTHON" ]; then
  own_torch="$("$base_python" - "$DNALLM_MIN_TORCH" <<'PY' 2>/dev/null || true
import os, sys
try:
    import torch
except Exception:
    sys.exit(0)
def key(v):
    return tuple(int(p) for p in v.split("+")[0].split(".")[:2])
if key(torch.__version__) >= key(sys.argv[1]):
    print(torch.__version__, os.path.dirname(os.path.dirname(torch.__file__)))
PY
)"
fi
if [ -n "$own_torch" ]; then
  mode="user torch ${own_torch%% *} in ${own_torch#* }"
else
  mode="pinned $(grep -E '^torch==' "$req")"
fi
stamp="$DNALLM_VENV/.dnallm-requirements"
want_stamp="$(sha256sum "$req" | cut -c1-16) $mode"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ] && [ -x "$DNALLM_PYTHON" ]; then
  echo "install-deps: Python environment $DNALLM_VENV ready ($mode)"
else
  start=$(date +%s)
  if [ ! -x "$DNALLM_PYTHON" ]; then
    echo "install-deps: making the Python environment $DNALLM_VENV"
    mkdir -p "$(dirname "$DNALLM_VENV")"
    "$base_python" -m venv "$DNALLM_VENV" || {
      echo "install-deps: '$base_python -m venv' failed (Debian: apt-get install python3-venv)" >&2
      exit 2
    }
  fi
  site="$("$DNALLM_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [ -n "$own_torch" ]; then
    # The user's torch stays where it is: the venv sees its site-packages through a .pth file
    # (after the venv's own, so the peers installed here win over the user's copies).
    echo "${own_torch#* }" > "$site/dnallm-user-torch.pth"
    echo "install-deps: LibTorch from your PyTorch ${own_torch%% *} (${own_torch#* });" \
         "DNALLM_OWN_TORCH=0 installs the pinned one instead"
    pip_req=(-r <(grep -vE '^torch==' "$req"))
  else
    rm -f "$site/dnallm-user-torch.pth"
    echo "install-deps: installing $(grep -E '^torch==' "$req") (CUDA-enabled wheel, runs on CPU too)" \
         "and the test peers into $DNALLM_VENV: about 5 GB on disk, 3 GB to download the first time"
    pip_req=(-r "$req")
  fi
  "$DNALLM_PYTHON" -m pip install -q --disable-pip-version-check "${pip_req[@]}"
  echo "$want_stamp" > "$stamp"
  echo "install-deps: Python environment ready in $(( $(date +%s) - start )) s," \
       "$(du -sh "$DNALLM_VENV" | cut -f1) ($mode)"
fi

if [ "$bench" = 1 ]; then
  # DNALLM pins its own transformers/torch range: it gets an environment of its own, sharing
  # our torch through a .pth file so both peers run the same torch.
  dvenv="$DNALLM_VENV-dnallm"
  if [ ! -f "$dvenv/.dnallm-ready" ]; then
    "$base_python" -m venv "$dvenv"
    "$dvenv/bin/python" -m pip install -q --disable-pip-version-check "$(grep -E '^dnallm' "$root/bench/requirements.txt")"
    touch "$dvenv/.dnallm-ready"
  fi
  echo "install-deps: DNALLM peer in $dvenv"
fi
