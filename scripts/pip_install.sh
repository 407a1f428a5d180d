# Sourced by bootstrap.sh and litellm_env.sh: `pip install` that shows progress, not pip's output.
#   pip_install PYTHON LOG ARGS...
# On a terminal one line counts the packages as pip resolves them, then says it is installing;
# elsewhere (CI logs) a line every 25 packages. pip's whole output goes to LOG; on failure its
# last lines are printed. The status is pip's own.
pip_install() {
    local python="$1" log="$2" tty=0 started=$SECONDS status=0
    shift 2
    [ -t 2 ] && tty=1
    mkdir -p "$(dirname "$log")"
    set +e
    "$python" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
        | tee "$log" \
        | awk -v tty="$tty" '
            function show(text) {
                if (tty) { printf "\r\033[K  %s", text > "/dev/stderr" }
                else { print "  " text > "/dev/stderr" }
                fflush("/dev/stderr")
            }
            /^(Collecting|Processing|Requirement already satisfied:) / {
                seen++
                name = ($1 == "Requirement") ? $4 : $2
                sub(/.*\//, "", name)          # a local wheel: its file name
                sub(/[-<>=!~;\[(].*/, "", name)  # the bare project name
                if (tty || seen % 25 == 0) show(sprintf("resolving: %d packages (%s)", seen, name))
            }
            /^Building (editable|wheel)/ { show("building the project ...") }
            /^Installing collected packages:/ {
                count = split(substr($0, 32), names, ",")
                show(sprintf("installing %d packages ...", count))
            }
            /^ERROR:/ { if (tty) printf "\n" > "/dev/stderr"; print > "/dev/stderr"; tty = 0 }
            END { if (tty) printf "\n" > "/dev/stderr" }'
    status=${PIPESTATUS[0]}
    set -e
    if [ "$status" -ne 0 ]; then
        echo "pip install failed ($status); the end of its output ($log):" >&2
        grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 30 >&2 || true
        return "$status"
    fi
    echo "  done in $((SECONDS - started)) s (pip's output: $log)" >&2
}
