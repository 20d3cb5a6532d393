#!/usr/bin/env bash
# Makes .venv at the repository root and installs omniscale into it (editable, with the dev
# extras). Idempotent: a second run with nothing changed returns in seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($py --version)"
    "$py" -m venv .venv
fi
stamp=.venv/.omniscale-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setup: installing omniscale and its dependencies into .venv (first time: a few minutes)"
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "$want" > "$stamp"
echo "setup: done"
