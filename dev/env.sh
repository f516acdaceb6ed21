# Sourced by dev/tileq and dev/test: make or reuse .venv with the pinned requirements and an
# editable install of tileq. Re-installs only when requirements-dev.txt or pyproject.toml change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[tileq] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.tileq-stamp"
WANT="$(cat "$ROOT/requirements-dev.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[tileq] installing pinned requirements into $VENV (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    "$VENV/bin/python" -c "import torch, triton, tileq" || { echo "[tileq] install failed" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
