#!/usr/bin/env bash
# Makes .venv at the repository root and installs omniscale into it (editable, with the dev
# extras). Idempotent: when pyproject.toml has not changed since the last install it returns at
# once, so every `make` target can call it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "setup: omniscale needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
    echo "setup: creating .venv with $("$py" --version)"
    "$py" -m venv .venv
fi
stamp=.venv/.omniscale-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setup: installing omniscale and its dependencies into .venv (first time: a minute or two)"
log=.venv/install.log
# pip's own output goes to a log: on failure its tail is shown, on success it is noise.
if ! { .venv/bin/python -m pip install --upgrade pip \
       && .venv/bin/python -m pip install -e ".[dev]"; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup: pip install failed; full log in $log" >&2
    exit 1
fi
echo "$want" > "$stamp"
# numba's kernels into their on-disk cache now, once, rather than in every process of the first
# run or test session at the same time (tools/warm_kernels.py)
echo "setup: compiling the planner's kernels (first time: under a minute)"
.venv/bin/python -m omniscale.tools.warm_kernels \
    || echo "setup: compiling the kernels failed; each run compiles what it needs" >&2
echo "setup: done"
