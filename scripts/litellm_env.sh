#!/usr/bin/env bash
# A cached virtualenv with the OLDEST supported LiteLLM and this project (editable), kept OUTSIDE
# git, for running the LiteLLM adapter's tests against the low end of the declared range.
#   scripts/litellm_env.sh          create or reuse it; prints its python's path on stdout
# The version is the floor of the `litellm` extra in pyproject.toml (`litellm[proxy]>=X,...`), so
# the range is declared once. Keyed by that version: a new floor makes a new venv. A reuse only
# re-runs the editable install when pyproject.toml or the checkout's path changed.
#   FAIR_SCHED_CACHE   cache root (default ~/.cache/fair-sched)
#   PYTHON             interpreter to build the venv from (default python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LITELLM_VERSION="$(sed -n 's/.*"litellm\[proxy\]>=\([0-9][0-9.a-z]*\),.*/\1/p' "$ROOT/pyproject.toml")"
if [ -z "$LITELLM_VERSION" ]; then
    echo "cannot read the oldest supported LiteLLM from pyproject.toml's litellm extra" >&2
    exit 1
fi
CACHE="${FAIR_SCHED_CACHE:-$HOME/.cache/fair-sched}"
VENV="$CACHE/litellm-venv-$LITELLM_VERSION"
STAMP="$VENV/.fair-sched-litellm-installed"
PYTHON_BIN="${PYTHON:-python3}"
WANT="$LITELLM_VERSION $ROOT $(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
    echo "$VENV/bin/python"
    exit 0
fi

mkdir -p "$CACHE"
started=$SECONDS
source "$ROOT/scripts/pip_install.sh"
if [ ! -f "$STAMP" ] || [ "$(cut -d' ' -f1 "$STAMP")" != "$LITELLM_VERSION" ]; then
    # A half-finished venv (interrupted install) is rebuilt from scratch rather than patched.
    rm -rf "$VENV"
    echo "installing litellm[proxy]==$LITELLM_VERSION into $VENV (~2 min, cached after) ..." >&2
    "$PYTHON_BIN" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip \
        >/dev/null 2>&1 || true
else
    echo "updating the project in $VENV (pyproject.toml or the checkout moved) ..." >&2
fi
# The project (editable, with its test tools) and the pinned LiteLLM in one resolve, so pip cannot
# move LiteLLM to another release to satisfy something else.
pip_install "$VENV/bin/python" "$CACHE/litellm-pip-$LITELLM_VERSION.log" \
    -e "$ROOT[dev]" "litellm[proxy]==$LITELLM_VERSION"
if ! LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c "import litellm.proxy.proxy_server, fair_sched_plugin" >&2; then
    echo "LiteLLM $LITELLM_VERSION in $VENV does not import" >&2
    exit 1
fi
echo "$WANT" > "$STAMP"
echo "litellm[proxy]==$LITELLM_VERSION ready in $((SECONDS - started)) s" >&2
echo "$VENV/bin/python"
