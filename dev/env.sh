# Sourced by dev/tileq and dev/test: make or reuse a virtual environment with tileq installed
# (editable). Re-installs only when a requirements file or pyproject.toml changes.
#
# TILEQ_ENV picks the environment:
#   pinned (default) -> .venv: the pinned requirements (requirements-dev.txt lists them), the
#                       versions the GPU machine runs: the whole test suite runs here.
#   latest           -> .venv-latest: the pinned torch, Triton and numpy (requirements.txt), then
#                       tileq[hf] as a user's `pip install` resolves it: the newest releases of
#                       transformers, safetensors, compressed-tensors and accelerate that
#                       pyproject.toml allows; the model-layer tests run a second time here.
#
# The first run installs one step at a time, saying before each what it installs and about how
# long it takes, one line per package while it runs, and after it how long it took; pip's whole
# output goes to $VENV/.tileq-install.log.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TILEQ_ENV="${TILEQ_ENV:-pinned}"
case "$TILEQ_ENV" in
    pinned) VENV="$ROOT/.venv" ;;
    latest) VENV="$ROOT/.venv-latest" ;;
    *) echo "[tileq] TILEQ_ENV: expected 'pinned' or 'latest', got '$TILEQ_ENV'" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[tileq] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.tileq-stamp"
WANT="$(cd "$ROOT" && cat requirements*.txt pyproject.toml | sha256sum | cut -d' ' -f1)"

# pip's output -> the log, and one line per package to the terminal.
_tileq_progress() {
    awk -v logf="$VENV/.tileq-install.log" '
        { print >> logf; fflush(logf) }
        /^Collecting / { print "           " $2; fflush() }
        /^Processing / { n = split($2, p, "/"); split(p[n], f, "-"); print "           " f[1] "==" f[2]; fflush() }
        /^Installing collected packages: / { n = split(substr($0, 32), a, ", "); print "           installing " n (n == 1 ? " package" : " packages"); fflush() }
        /^ERROR/ { print; fflush() }'
}

# _tileq_step N WHAT ESTIMATE PIP-ARGS...: install step N, with its progress and its time.
_tileq_step() {
    local n="$1" what="$2" estimate="$3" t0=$SECONDS
    shift 3
    echo "[tileq] ($n/$STEPS) $what: about $estimate" >&2
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
    STEPS=$([ "$TILEQ_ENV" = pinned ] && echo 4 || echo 3)
    : > "$VENV/.tileq-install.log"
    echo "[tileq] installing the $TILEQ_ENV environment into $VENV (first run: about 2 minutes)" >&2
    # Later steps keep the earlier pins (-c): the test libraries never move torch or transformers.
    _tileq_step 1 "runtime: torch (CPU build), triton, numpy (requirements.txt)" "40 s" \
        -r requirements.txt
    if [ "$TILEQ_ENV" = pinned ]; then
        _tileq_step 2 "models and checkpoints: transformers, safetensors, compressed-tensors, accelerate (requirements-hf.txt)" \
            "25 s" -r requirements-hf.txt -c requirements.txt
        _tileq_step 3 "tests: pytest, hypothesis, matplotlib and the libraries the format tests drive (requirements-test.txt, requirements-producers.txt)" \
            "40 s" -r requirements-test.txt -r requirements-producers.txt -c requirements.txt -c requirements-hf.txt
        _tileq_step 4 "tileq itself, editable (pyproject.toml)" "5 s" \
            --no-deps --no-build-isolation -e .
    else
        _tileq_step 2 "tileq[hf], editable, with the newest releases of transformers and its companions that pyproject.toml allows" \
            "30 s" --no-build-isolation -e '.[hf]' -c requirements.txt
        _tileq_step 3 "tests: pytest, hypothesis, matplotlib and the libraries the format tests drive (requirements-test.txt, requirements-producers.txt)" \
            "40 s" -r requirements-test.txt -r requirements-producers.txt -c requirements.txt
    fi
    echo "[tileq] versions:" $("$VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
        | awk 'tolower($1) ~ /^(torch|triton|numpy|transformers|safetensors|compressed-tensors|accelerate)$/ \
               { printf "%s %s, ", $1, $2 }' | sed 's/, $//') >&2
    "$VENV/bin/python" -c "import torch, triton, tileq" || { echo "[tileq] install failed: import tileq" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
    echo "[tileq] installed in $((SECONDS - T0)) s; later runs reuse $VENV" >&2
fi
export PATH="$VENV/bin:$PATH"
