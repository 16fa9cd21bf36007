#!/usr/bin/env bash
# Opens the MLflow UI on this checkout's tracking store (the `tracking` section of params.yaml).
# Usage: infra/local/mlflow-ui.sh [PORT]   then browse http://127.0.0.1:PORT (default 5000)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bash scripts/bootstrap.sh
exec .venv/bin/mlflow ui --backend-store-uri "sqlite:///$PWD/mlflow.db" \
  --default-artifact-root "$PWD/mlartifacts" --host 127.0.0.1 --port "${1:-5000}"
