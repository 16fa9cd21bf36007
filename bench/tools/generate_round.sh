#!/usr/bin/env bash
# Device calls for the inference benches (and the AC planner's training step) on the lent H200 (through the device tool, from the
# repository root, carrying .whl/: diffusers, av and their pure-Python needs, which the image lacks).
# Parts run in the order given; logs and JSON rows go to $OUT (or ./device_out); a part's failure is
# kept in the exit status and the next part still runs.
#   bash bench/tools/generate_round.sh make bf16 fp8 w4a4      # ~8 min: full-size folders, then generate's rows
#   bash bench/tools/generate_round.sh make kernels vae sp
#   bash bench/tools/generate_round.sh attention            # ~2 min: bench/attention_kernels.py alone (kernels: its tests first)
#   bash bench/tools/generate_round.sh make profile          # ~5 min: each KV format's kernels over a 5-chunk video
#   bash bench/tools/generate_round.sh make profile_fp8      # ~5 min: the same for FP8 linears and FP8 attention
#   bash bench/tools/generate_round.sh make fp8_sync         # ~7 min: BF16 against FP8 linears (+ FP8 attention), decode sync
#   bash bench/tools/generate_round.sh make prompt_embedding   # ~1 min: umT5 loaded per prompt file or kept on the host
#   bash bench/tools/generate_round.sh make parity           # ~6 min: the NVFP4 KV cache against BF16's, twice each
#   bash bench/tools/generate_round.sh make parity_sync      # ~7 min: the same with decode sync (the DiT's loop alone)
#   bash bench/tools/generate_round.sh make host_sync        # ~6 min: the host's side of BF16's and NVFP4's loops (cProfile)
#   bash bench/tools/generate_round.sh fos_sweep             # ~1.5 min: the 4/6 quantize tile for the NVFP4 cache's writes
#   bash bench/tools/generate_round.sh make fp8_attention    # ~6 min: cuDNN FP8 attention in generate, BF16 and FP8 linears
#   bash bench/tools/generate_round.sh vae_demo train      # no folders needed; train keeps its plans in $OUT
#   bash bench/tools/generate_round.sh gpu_tests train_nvfp4 train16 caption   # gpu_tests ~2 min
#   bash bench/tools/generate_round.sh gpu_quant_tests       # ~4.5 min: the quantize kernels against torch, every variant
#   bash bench/tools/generate_round.sh fp8_layers            # ~2 min: cuDNN FP8 attention's error layer by layer,
#                                                           # then layer 1's accumulator modelled on the CPU
#   bash bench/tools/generate_round.sh dmd                   # ~6 min: distill_dmd's budget plans against full and none
#   bash bench/tools/generate_round.sh dmd16                 # ~5 min: production's limit at 16 blocks (distill_dmd's rate)
#   bash bench/tools/generate_round.sh train16_nvfp4         # ~5 min (on an H100), a call of its own: the same for train_ar (NVFP4)
#   bash bench/tools/generate_round.sh dmd_memory            # ~2 min: what distill_dmd's full iteration holds at its peak
#   bash bench/tools/generate_round.sh dmd16_peak            # ~4 min: dmd16's full and budget, and what budget's peak holds
#   bash bench/tools/generate_round.sh vae_profile           # ~3 min: where the compiled decoder's time goes
#   bash bench/tools/generate_round.sh vae_sp                # ~8 min: sub-pixel upsampling, with 1, 2 and 4 frames a call
#                                                           # (the first two variants took 5 min on an H100)
#   bash bench/tools/generate_round.sh vae_bm                # ~5 min: cuDNN's autotuner against the default
#                                                           # (three compiled variants in one call overran 7.5 min)
#   bash bench/tools/generate_round.sh memory                # ~4 min: what the step's peak holds (NVFP4 full against budget)
# $OUT returns at most 8 files: tar what a call writes (ac-plans/ holds one file per plan)
set -u
out=${OUT:-device_out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
if [[ -d .whl ]] && [[ ! -d /tmp/site ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$out/pip.log" 2>&1 || { echo "wheel install failed"; tail "$out/pip.log"; }
fi
status=0
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
    "$@" > "$out/$name.log" 2>&1 || { status=1; echo "!! $name failed"; }
    echo "   $((SECONDS - t0)) s"; grep -v -i "warn" "$out/$name.log" | tail -n 14; }
root=/tmp/llp
for part in "$@"; do case $part in
    make) w4a4=--w4a4  # the W4A4 folder is written through compressed-tensors (pure Python: carry its wheel)
          python3 -c "import compressed_tensors" 2>/dev/null || { w4a4=; echo "   no compressed_tensors here: no W4A4 folder"; }
          [[ -f $root/prompts.txt ]] || run make python3 bench/generate_product.py make $root $w4a4 ;;
    bf16) run bf16 python3 bench/generate_product.py run $root --model dit --precision bf16 --rows bf16:4,bf16:2,nvfp4:4 --json "$out/product.jsonl" ;;
    fp8) run fp8 python3 bench/generate_product.py run $root --model dit --precision fp8 --rows bf16:4,fp8:4 \
             --json "$out/product.jsonl" ;;  # FP8 weights with the BF16 and the FP8 KV cache
    fp8_attention) run fp8_attention_bf16 python3 bench/generate_product.py run $root --model dit --precision bf16 \
                       --rows bf16:4,bf16:4:fp8 --json "$out/product.jsonl"  # cuDNN FP8 attention in generate (after make)
                   run fp8_attention_fp8 python3 bench/generate_product.py run $root --model dit --precision fp8 \
                       --rows bf16:4:fp8 --json "$out/product.jsonl" ;;  # with FP8 linears: the 1.3x goal
    parity) run parity python3 bench/generate_product.py run $root --model dit --precision bf16 \
                --rows bf16:4,nvfp4:4,bf16:4,nvfp4:4 --json "$out/product.jsonl" ;;  # the NVFP4 cache against BF16's,
                # each twice in one process (one pair spread 2%; after make)
    parity_sync) run parity_sync python3 bench/generate_product.py run $root --model dit --precision bf16 \
                     --rows bf16:4,nvfp4:4,bf16:4,nvfp4:4 --decode sync --json "$out/product.jsonl" ;;  # the same pairs,
                     # the DiT's loop alone (no decoder kernels beside it on the GPU)
    fp8_sync) run fp8_sync_bf16 python3 bench/generate_product.py run $root --model dit --precision bf16 --rows bf16:4 \
                  --decode sync --json "$out/product.jsonl"  # the DiT's loop alone on its GPU: the 1.3x goal's loop
              run fp8_sync_fp8 python3 bench/generate_product.py run $root --model dit --precision fp8 --rows bf16:4,bf16:4:fp8 \
                  --decode sync --json "$out/product.jsonl" ;;
    profile_fp8) run profile_fp8 python3 bench/generate_product.py run $root --model dit --precision fp8 --rows bf16:4:fp8 \
                     --profile-chunks 5 ;;  # FP8 linears and cuDNN's FP8 attention: where the 1.3x goal is lost (after make)
    host_sync) run host_sync python3 bench/generate_product.py run $root --model dit --precision bf16 \
                   --rows bf16:4,nvfp4:4 --decode sync --host-profile-chunks 16 ;;  # the host's side of each KV
                   # format's loop (cProfile over a 16-chunk video): whether the NVFP4 reads' host time shows (after make)
    fos_sweep) run fos_sweep python3 bench/nvfp4_quant.py --quick --fos-sweep --best-out "$out/tiles.json" ;;  # the 4/6
               # row tile at the KV write's shape, each candidate's bits checked (generate_product.py --quant-tiles)
    profile) run profile python3 bench/generate_product.py run $root --model dit --precision bf16 --rows bf16:4,nvfp4:4 \
                 --profile-chunks 5 ;;  # where the NVFP4 cache's loop loses its 2% to the BF16 cache's (after make)
    prompt_embedding) run prompt_embedding python3 bench/prompt_embedding.py $root/umt5 --json "$out/prompt_embedding.jsonl" ;;
    w4a4) run w4a4 python3 bench/generate_product.py run $root --model w4a4 --rows nvfp4:4 --json "$out/product.jsonl" ;;
    kernels)
        run kernel_tests python3 -m pytest -q --noconftest -p tests.helpers.gloo tests/test_infer_kv_attention.py tests/test_infer_attention_8bit.py tests/test_infer_attention_fp8_io.py \
            tests/test_infer_attention_cudnn_fp8.py
        run attention python3 bench/attention_kernels.py --json "$out/attention.jsonl" ;;
    attention) run attention python3 bench/attention_kernels.py --json "$out/attention.jsonl" ;;  # kernels' bench alone
    fp8_layers) run fp8_layers python3 bench/fp8_attention_layers.py --json "$out/fp8_layers.jsonl" \
                    --dump /tmp/fp8_layer1.safetensors --dump-layer 1
                run fp8_accumulation python3 bench/fp8_accumulation.py /tmp/fp8_layer1.safetensors ;;
    vae) run vae python3 bench/vae_decode.py ;;
    vae_demo) run vae_demo python3 bench/vae_decode.py --content demo --variants bf16,bf16-compile-cl-sp,bf16-compile-cl ;;
    vae_profile) run vae_profile python3 bench/vae_decode.py --chunks 4 --variants bf16-compile-cl-sp --profile ;;
    vae_sp) run vae_sp python3 bench/vae_decode.py --chunks 4 \
                --variants bf16-compile-cl-sp,bf16-compile-cl,bf16-compile-cl-sp-f2,bf16-compile-cl-sp-f4 --explain ;;  # the
                # product's decoder (sub-pixel upsampling) against the plain one, then with 2 and 4 latent frames a call
    vae_bm) run vae_bm python3 bench/vae_decode.py --chunks 4 --variants bf16-compile-cl,bf16-compile-cl-bm ;;
    train) run train python3 bench/train_step.py --blocks 8 --frames 32 --recipes bf16 --compile 1 --steps 2 \
               --ac budget:47 compiler:0.2 budget:65 compiler:0.5 full --out "$out" ;;
    train_nvfp4) run train_nvfp4 python3 bench/train_step.py --blocks 8 --frames 32 --recipes nvfp4 --compile 1 \
               --steps 2 --ac budget:47 budget:43.2 compiler:0.2 full --out "$out" ;;  # 43.2: the knob's step peak
    train16_nvfp4) run train16_nvfp4 python3 bench/train_step.py --blocks 16 --frames 32 --recipes nvfp4 --compile 1 \
                   --steps 2 --ac budget compiler:0.2 full --out "$out" ;;  # production's recipe at its limit (0.9
                   # of the GPU), with blocks enough that not every one fits unchecked: the rate production's
                   # train_ar needs before it takes `budget`
    train16) run train16 python3 bench/train_step.py --blocks 16 --frames 32 --recipes bf16 --compile 1 --steps 2 \
               --ac budget:120 compiler:0.3 full --out "$out" ;;
    memory) for config in nvfp4/full nvfp4/budget:47; do  # what each step's peak holds, line by line (full kept 22 GiB
                                                           # more before 9f3855e)
                recipe=${config%%/*} ac=${config#*/}
                run "memory_${recipe}_${ac/:/}" python3 bench/train_step.py --blocks 8 --frames 32 --recipes $recipe \
                    --compile 1 --steps 1 --ac $ac --memory-peak --out "$out"; done ;;
    gpu_tests) run gpu_tests python3 -m pytest -q --noconftest -p tests.helpers.gloo tests/test_ac_budget.py \
               tests/test_infer_kv_attention.py tests/test_infer_attention_8bit.py tests/test_infer_attention_cudnn_fp8.py tests/test_infer_attention_fp8_io.py \
               tests/test_quant_triton.py tests/test_quant_packed.py tests/test_train_parallelize.py tests/test_infer_vae_upsample.py tests/test_gpu_host_sync.py tests/test_infer_text_encoder.py --durations=10 \
               -k "(gpu or compiled or cuda or under_compile) and not test_triton_matches_torch_on_the_gpu" ;;
    gpu_quant_tests) run gpu_quant_tests python3 -m pytest -q --noconftest -p tests.helpers.gloo tests/test_quant_triton.py \
                     -k test_triton_matches_torch_on_the_gpu ;;  # ~4.5 min on the H200: every quantize variant compiled
    dmd) i=0; for ac in full budget budget:30 none full; do  # distill_dmd's planner (budget: production's limit,
             i=$((i + 1))                                       # 0.9 of the GPU) against full, twice, and none
             run "dmd${i}_${ac/:/}" python3 bench/dmd_step.py --blocks 8 --frames 32 --modes nvfp4-lora --steps 2 \
                 --ac "$ac" --out "$out/dmd${i}_${ac/:/}"; done ;;  # NVFP4 + LoRA, each in its own process
    dmd16) i=0; for ac in full budget full; do  # production's limit with blocks enough that not every one
               i=$((i + 1))                             # fits unchecked (8 blocks: all did), for a rate nearer 30's
               run "dmd16_${i}_${ac}" python3 bench/dmd_step.py --blocks 16 --frames 32 --modes nvfp4-lora --steps 2 \
                   --ac "$ac" --out "$out/dmd16_${i}_${ac}"; done ;;
    dmd16_peak) run dmd16_peak_full python3 bench/dmd_step.py --blocks 16 --frames 32 --modes nvfp4-lora --steps 2 \
                    --ac full --out "$out/dmd16_peak_full"  # dmd16's full and budget, then what budget's peak holds
                run dmd16_peak_budget python3 bench/dmd_step.py --blocks 16 --frames 32 --modes nvfp4-lora --steps 2 \
                    --ac budget --memory-peak --out "$out/dmd16_peak_budget" ;;
    dmd_memory) run dmd_memory python3 bench/dmd_step.py --blocks 8 --frames 32 --modes nvfp4-lora --steps 1 --ac full \
                    --memory-peak --out "$out/dmd_memory" ;;  # where distill_dmd's full step peaks, line by line
    caption) run caption python3 bench/caption_throughput.py --repeats 3 --json "$out/caption.jsonl" ;;
    sp) run sp python3 bench/generate_sp_projection.py --compile ;;
    *) echo "unknown part $part"; status=1 ;;
esac; done
exit $status
