# Sourced by scripts/test and scripts/demo: a project virtualenv with every extra installed.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
# LiteLLM must never fetch its price list from the internet (also while checking the install).
export LITELLM_LOCAL_MODEL_COST_MAP=True
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FAIR_SCHED_VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON_BIN" -m venv "$VENV"
fi
STAMP="$VENV/.fair-sched-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "installing fair-sched-plugin and its extras into $VENV ..." >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[dev,litellm,redis,bench]" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
    "$VENV/bin/python" -c "import fair_sched_plugin, litellm, redis, matplotlib" \
        || { echo "installation failed" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
fi
# The shared-state tests (tests/state) start their own redis-server on 127.0.0.1. CI runs as root
# on a fresh machine: install it there; elsewhere say how (the tests skip without it, except in CI).
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing redis-server for the shared-state tests ..." >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; } \
            >/dev/null 2>&1 || echo "could not install redis-server with apt-get" >&2
    else
        echo "redis-server not found: install it (apt-get install redis-server) to run the" \
            "shared-state tests; they skip without it (and fail when CI=true)" >&2
    fi
fi
export PATH="$VENV/bin:$PATH"
