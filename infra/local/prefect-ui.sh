#!/usr/bin/env bash
# Starts a local Prefect server and UI (state in .prefect/ of this checkout, or $PREFECT_HOME).
# Usage: infra/local/prefect-ui.sh [PORT]   then browse http://127.0.0.1:PORT (default 4200), and
# in another shell run flows against it:
#   export PREFECT_HOME=$PWD/.prefect PREFECT_API_URL=http://127.0.0.1:PORT/api
#   .venv/bin/longlive-flow
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bash scripts/bootstrap.sh
port="${1:-4200}"
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
# the UI in the browser asks the server for its API's address: this port's, not the default 4200
export PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_SERVER_API_PORT="$port"
export PREFECT_UI_API_URL="http://127.0.0.1:$port/api"
exec .venv/bin/prefect server start --host 127.0.0.1 --port "$port"
