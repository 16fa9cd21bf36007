#!/usr/bin/env bash
# Creates .venv/ at the repo root and installs the project with every version pinned by
# constraints.txt. Re-installs only when pyproject.toml or constraints.txt changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
stamp=".venv/.installed"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# the environment takes ~7.7 GiB (torch's CUDA libraries most of it) and pip unpacks beside it: say so
# up front rather than fail half-installed on "No space left on device"
need_kib=$((9 * 1024 * 1024))
free_kib="$(df -Pk "$root" | awk 'NR == 2 {print $4}')"
if [ -n "$free_kib" ] && [ "$free_kib" -lt "$need_kib" ]; then
  echo "[bootstrap] $root has $((free_kib / 1024 / 1024)) GiB free; installing the environment needs about 9 GiB:" \
       "free space on that disk (old clones and their .venv, /tmp/pytest-of-*) and run this again" >&2
  exit 1
fi
echo "[bootstrap] installing into $root/.venv (pinned by constraints.txt)"
[ -x .venv/bin/python ] || "$py" -m venv .venv
# pip warns about every local index folder this machine's pip.conf names but lacks: hide that noise
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
quiet .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt pip setuptools
quiet .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation \
  -c constraints.txt -e '.[dev]'
echo "$want" > "$stamp"
echo "[bootstrap] done"
