# Sourced by scripts/test and scripts/demo: a project virtualenv with every extra installed.
# Re-installs only when pyproject.toml changed since the last install. What the user sees is the
# install's progress; pip's own output goes to $VENV/pip-install.log (printed if it fails).
set -euo pipefail
# LiteLLM must never fetch its price list from the internet (also while checking the install).
export LITELLM_LOCAL_MODEL_COST_MAP=True
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FAIR_SCHED_VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON:-python3}"
source "$ROOT/scripts/pip_install.sh"
STAMP="$VENV/.fair-sched-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        echo "fair-sched: creating a virtualenv in $VENV (first run only; the install takes a" \
            "few minutes) ..." >&2
        "$PYTHON_BIN" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip \
            >/dev/null 2>&1 || true
    fi
    echo "fair-sched: installing fair-sched-plugin with LiteLLM, Redis, plotting and test tools" >&2
    pip_install "$VENV/bin/python" "$VENV/pip-install.log" -e "$ROOT[dev,litellm,redis,bench]"
    "$VENV/bin/python" -c "import fair_sched_plugin, litellm, redis, matplotlib" \
        || { echo "installation failed: the packages do not import" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
