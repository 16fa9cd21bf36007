#!/usr/bin/env bash
# Starts a local Prefect server and UI (state in .prefect/ of this checkout).
# Usage: infra/local/prefect-ui.sh [PORT]   then browse http://127.0.0.1:PORT (default 4200), and
# in another shell run flows against it:
#   export PREFECT_HOME=$PWD/.prefect PREFECT_API_URL=http://127.0.0.1:4200/api
#   .venv/bin/longlive-flow
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bash scripts/bootstrap.sh
export PREFECT_HOME="$PWD/.prefect"
exec .venv/bin/prefect server start --host 127.0.0.1 --port "${1:-4200}"
