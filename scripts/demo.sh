#!/usr/bin/env bash
# Sets everything up (into .venv/, if needed) and runs the whole pipeline on the demo defaults.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH" DVC_NO_ANALYTICS=1
dvc repro "$@"
longlive-record-pipeline
