#!/usr/bin/env bash
# Sets everything up (into .venv/, if needed) and runs the full test suite, slow tests included.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the quick ones.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH" DVC_NO_ANALYTICS=1
# one worker a core, at most 4, a file's tests on one worker, in tests/conftest.py's order (it also shares
# the cores' threads among the workers); `-n 0` runs them in this process
exec python -m pytest -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder "$@"
