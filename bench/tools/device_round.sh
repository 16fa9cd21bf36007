#!/usr/bin/env bash
# One device call that checks and measures the NVFP4 library, for the lent H200 (through the device
# tool, from the repository root): the selfcheck as three parallel processes (each waited on by its
# PID, so a failure's exit status is kept), then the benches one after another (never beside the
# selfcheck: its kernels would share the GPU with the timed ones). Logs go to $OUT (or ./device_out);
# the last lines printed are the summaries. About 8 minutes; pass bench names to run fewer:
#   bash bench/tools/device_round.sh [selfcheck] [quant] [sweep] [linear] [host] [launch]
set -u
out=${OUT:-device_out}
mkdir -p "$out"
export PYTHONPATH=.
want=${*:-selfcheck quant linear host launch}
has() { [[ " $want " == *" $1 "* ]]; }
status=0
if has selfcheck; then
    python -m longlive_core.quant.selfcheck --part rows > "$out/selfcheck_rows.log" 2>&1 & p1=$!
    python -m longlive_core.quant.selfcheck --part slices > "$out/selfcheck_slices.log" 2>&1 & p2=$!
    python -m longlive_core.quant.selfcheck --part blocks gemm rht launch > "$out/selfcheck_rest.log" 2>&1 & p3=$!
    for p in $p1 $p2 $p3; do wait "$p" || status=1; done
    tail -n 1 "$out"/selfcheck_*.log
fi
if has quant; then python bench/nvfp4_quant.py --quick > "$out/quant.log" 2>&1 || status=1; fi
if has sweep; then python bench/nvfp4_quant.py --quick --block-sweep codes_rht > "$out/sweep.log" 2>&1 || status=1; fi
if has linear; then python bench/nvfp4_linear.py --tokens 16384 --rounds 11 > "$out/linear.log" 2>&1 || status=1; fi
if has host; then python bench/tools/linear_host.py > "$out/host.log" 2>&1 || status=1; fi
if has launch; then python bench/tools/launch_cost.py > "$out/launch.log" 2>&1 || status=1; fi
for f in quant sweep linear host launch; do
    [[ -f "$out/$f.log" ]] && { echo "== $f"; grep -v -i "warn" "$out/$f.log" | tail -n 16; }
done
exit $status
