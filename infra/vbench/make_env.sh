#!/usr/bin/env bash
# Makes official VBench's isolated environment (evaluate.vbench.python points at its interpreter):
#   infra/vbench/make_env.sh [DIR]            DIR defaults to .venv-vbench
# Needs Python 3.10 or 3.11 ($VBENCH_PYTHON, default python3.11) and a package index; VBench's weights are
# not fetched here: put them in the folder evaluate.vbench.cache names (VBENCH_CACHE_DIR's layout,
# longlive_core/evaluate/vbench_run.py lists the files each dimension reads). The PyPI wheel of
# VBench 0.1.5 lacks VBench-Long's configs/ folder, which subject and background consistency read in
# long mode: set VBENCH_SOURCE to a VBench checkout (or git URL) to install that instead.
set -euo pipefail
dir=${1:-.venv-vbench}
python=${VBENCH_PYTHON:-python3.11}
if ! command -v "$python" > /dev/null; then
  echo "make_env: $python not found; install Python 3.10 or 3.11, or set VBENCH_PYTHON to one" >&2
  exit 2
fi
"$python" -m venv "$dir"
"$dir/bin/python" -m pip install --quiet --upgrade pip
"$dir/bin/python" -m pip install --quiet -r "$(dirname "$0")/requirements.txt"
if [ -n "${VBENCH_SOURCE:-}" ]; then  # a VBench checkout (or git URL): it has vbench2_beta_long/configs/, the wheel not
  "$dir/bin/python" -m pip install --quiet --no-deps --force-reinstall "$VBENCH_SOURCE"
fi
"$dir/bin/python" -c "import vbench2_beta_long, transformers, numpy; print('vbench env ready:', transformers.__version__, numpy.__version__)"
echo "set evaluate.vbench.python: $dir/bin/python"
