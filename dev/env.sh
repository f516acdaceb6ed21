# Sourced by dev/tileq and dev/test: make or reuse .venv with the pinned requirements and an
# editable install of tileq. Re-installs only when a requirements file or pyproject.toml changes.
#
# The first run installs requirements.txt (runtime), requirements-hf.txt (models, checkpoints)
# and requirements-test.txt (tests) one by one, saying before each what it installs and about how
# long it takes, one line per package while it runs, and after it how long it took; pip's whole
# output goes to .venv/.tileq-install.log.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[tileq] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.tileq-stamp"
WANT="$(cd "$ROOT" && cat requirements.txt requirements-hf.txt requirements-test.txt requirements-dev.txt \
    pyproject.toml | sha256sum | cut -d' ' -f1)"

# pip's output -> the log, and one line per package to the terminal.
_tileq_progress() {
    awk -v logf="$VENV/.tileq-install.log" '
        { print >> logf; fflush(logf) }
        /^Collecting / { print "           " $2; fflush() }
        /^Processing / { n = split($2, p, "/"); split(p[n], f, "-"); print "           " f[1] "==" f[2]; fflush() }
        /^Installing collected packages: / { n = split(substr($0, 32), a, ", "); print "           installing " n (n == 1 ? " package" : " packages"); fflush() }
        /^ERROR/ { print; fflush() }'
}

# _tileq_step N WHAT ESTIMATE PIP-ARGS...: install step N of 4, with its progress and its time.
_tileq_step() {
    local n="$1" what="$2" estimate="$3" t0=$SECONDS
    shift 3
    echo "[tileq] ($n/4) $what: about $estimate" >&2
    if ! (cd "$ROOT" && "$VENV/bin/python" -m pip install --disable-pip-version-check "$@" 2>&1) \
            | _tileq_progress >&2; then
        echo "[tileq] install failed; the end of pip's output (all of it: $VENV/.tileq-install.log):" >&2
        tail -n 25 "$VENV/.tileq-install.log" >&2
        exit 1
    fi
    echo "[tileq]       done in $((SECONDS - t0)) s" >&2
}

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    T0=$SECONDS
    : > "$VENV/.tileq-install.log"
    echo "[tileq] installing the pinned requirements into $VENV (first run: about 2 minutes)" >&2
    # Later steps keep the earlier pins (-c): the test libraries never move torch or transformers.
    _tileq_step 1 "runtime: torch (CPU build), triton, numpy (requirements.txt)" "40 s" \
        -r requirements.txt
    _tileq_step 2 "models and checkpoints: transformers, safetensors (requirements-hf.txt)" "20 s" \
        -r requirements-hf.txt -c requirements.txt
    _tileq_step 3 "tests: pytest, hypothesis, matplotlib and the libraries the format tests drive (requirements-test.txt)" \
        "40 s" -r requirements-test.txt -c requirements.txt -c requirements-hf.txt
    _tileq_step 4 "tileq itself, editable (pyproject.toml)" "5 s" \
        --no-deps --no-build-isolation -e .
    "$VENV/bin/python" -c "import torch, triton, tileq" || { echo "[tileq] install failed: import tileq" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
    echo "[tileq] installed in $((SECONDS - T0)) s; later runs reuse $VENV" >&2
fi
export PATH="$VENV/bin:$PATH"
