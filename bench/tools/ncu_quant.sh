#!/usr/bin/env bash
# Nsight Compute on the block kernel's three round-two launches of bench/tools/quant_launches.py
# (amaxes, plain codes, RHT codes with the amax given), on the lent H200 through the device tool
# (ncu reads the counters on its Firecracker machines; clocks left alone). Writes to $OUT: the
# report, its details page, and the RHT codes kernel's per-instruction source page (SASS, with
# warp stall samples).
#   bash bench/tools/ncu_quant.sh
set -eu
out=${OUT:-device_out}
mkdir -p "$out"
export PYTHONPATH=.
ncu --clock-control none --set full --import-source no -k regex:_block_kernel --launch-skip 3 --launch-count 3 \
    -f -o "$out/blocks" python3 bench/tools/quant_launches.py > "$out/ncu_run.log" 2>&1
ncu -i "$out/blocks.ncu-rep" --page details > "$out/blocks_details.txt"
ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:_block_kernel \
    --launch-skip 5 --launch-count 1 -f -o "$out/rht" python3 bench/tools/quant_launches.py >> "$out/ncu_run.log" 2>&1
# the source page is a convenience (older ncu lacks it): its error, if any, lands in the csv
ncu -i "$out/rht.ncu-rep" --page source --csv --print-source sass > "$out/rht_source.csv" 2>&1 || true
