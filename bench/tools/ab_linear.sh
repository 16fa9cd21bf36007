#!/usr/bin/env bash
# The eager linear's 3072 -> 3072 row for the working tree and an older commit, alternated in fresh
# processes on one machine (the lent machines' CPUs differ from call to call, and one process's
# eager figure from the next by up to 0.3x: see RESULTS, iteration 7). Through the device tool:
#   bash bench/tools/ab_linear.sh OLD_COMMIT [PAIRS=2] [TOKENS=16384]
set -eu
old=$1
pairs=${2:-2}
tokens=${3:-16384}
tree=$(mktemp -d)
git archive "$old" | tar -x -C "$tree"
row() { PYTHONPATH=. python bench/nvfp4_linear.py --tokens "$tokens" --rounds 7 2>&1 | grep "3072 -> 3072"; }
for _ in $(seq "$pairs"); do
    echo "== working tree ($(git rev-parse --short HEAD))"; row
    echo "== $old"; (cd "$tree" && row)
done
rm -rf "$tree"
