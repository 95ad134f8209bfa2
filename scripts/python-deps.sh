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

# An environment's stamp, VENV/.dnallm-requirements, says what was installed in it: the hash of
# its requirements file (and, for ours, where torch came from), written after the install.
#   installed VENV STAMP    whether VENV's stamp holds STAMP and VENV/bin/python runs
#   stamp VENV STAMP        after an install
#   requirements_hash FILE  the hash a stamp holds of FILE
#   purelib PYTHON          the site-packages folder of an interpreter
installed() {
  [ -f "$1/.dnallm-requirements" ] && [ "$(cat "$1/.dnallm-requirements")" = "$2" ] &&
    [ -x "$1/bin/python" ]
}
stamp() { echo "$2" > "$1/.dnallm-requirements"; }
requirements_hash() { sha256sum "$1" | cut -c1-16; }
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

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
want_stamp="$(requirements_hash "$req") $mode"

if installed "$DNALLM_VENV" "$want_stamp"; then
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
  site="$(purelib "$DNALLM_PYTHON")"
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
  stamp "$DNALLM_VENV" "$want_stamp"
  echo "install-deps: Python environment ready in $(( $(date +%s) - start )) s," \
       "$(du -sh "$DNALLM_VENV" | cut -f1) ($mode)"
fi

if [ "$bench" = 1 ]; then
  # DNALLM (bench/requirements.txt) pins torch<2.12 and its own transformers range: it gets an
  # environment of its own, made from our interpreter, that sees our venv's site-packages
  # through a .pth file (after its own, so what is installed there wins), so DNALLM runs on
  # the very torch (and transformers/peft/accelerate) that dnallm-train links. DNALLM itself
  # goes in with --no-deps (its torch pin would pull a second torch); the lines after it are
  # the dependencies its fine-tune path imports.
  dvenv="$DNALLM_VENV-dnallm"
  breq="$root/bench/requirements.txt"
  want_dstamp="$(requirements_hash "$breq")"
  if installed "$dvenv" "$want_dstamp"; then
    echo "install-deps: DNALLM peer ready in $dvenv"
  else
    start=$(date +%s)
    [ -x "$dvenv/bin/python" ] || "$DNALLM_PYTHON" -m venv "$dvenv" || {
      echo "install-deps: '$DNALLM_PYTHON -m venv $dvenv' failed" >&2
      exit 2
    }
    site="$(purelib "$DNALLM_PYTHON")"
    dsite="$(purelib "$dvenv/bin/python")"
    echo "$site" > "$dsite/dnallm-project-venv.pth"
    pip=("$dvenv/bin/python" -m pip install -q --disable-pip-version-check)
    # pip reports dnallm's unmet pins (torch<2.12, jax, wandb, ...) as conflicts: expected.
    "${pip[@]}" --no-deps "$(grep -E '^dnallm==' "$breq")"
    "${pip[@]}" -r <(grep -vE '^dnallm==' "$breq") 2>&1 | grep -vE "^dnallm .* requires |^ERROR: pip's dependency resolver|^This behaviour is the source" || true
    "$dvenv/bin/python" -c 'import dnallm, torch; print("install-deps: DNALLM", dnallm.__version__, "on torch", torch.__version__)' || {
      echo "install-deps: DNALLM does not import in $dvenv (see above)" >&2
      exit 2
    }
    stamp "$dvenv" "$want_dstamp"
    echo "install-deps: DNALLM peer ready in $dvenv in $(( $(date +%s) - start )) s"
  fi
fi
