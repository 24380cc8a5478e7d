#!/usr/bin/env bash
# One device call: GPU tests, then train-step benchmarks. Usage (on the GPU machine, repo root):
#   bash benchmarks/run_gpu.sh OUT_DIR [tests] [gpu-tests] [plain] [liger] [profile] [runner] [qlora|qlora-on|qlora-off]
#       [qlora-liger] [moe|moe-off|moe-on] [moe-liger] [moe-profile] [dist-1] [dist-2] [dist-prefetch] [dist-nf4] [dist-tests] [runner-default]
#       [peers] [memory] [fp8] [bar] [moe-bar] [fp8-bar] [nf4-bar] [stream-bar] [stream-bar-70b] [long-context]
#       [checkpoint-dequant] [gptq-bar] [nvfp4-bar] [dora-bar] [dpo] [dpo-graphs] [dpo-variants] [shared-gathers] [kept-short] [sequence-parallel]
# Missing packages (pydantic, liger-kernel, bitsandbytes, torchao, the Unsloth stack) are installed from the
# wheels in .whl/ when that folder exists (benchmarks/fetch_wheels.sh fills it; carry .whl).
# qlora: the QLoRA table at the Llama-3-8B shape, one run (and table) per checkpointing mode, so a cut-short
# call keeps the first; qlora-on / qlora-off run one mode each. All QLoRA parts share one saved random-weight
# checkpoint ($ckpt), written by the first of them.
# moe: the same protocol at the Qwen3-30B-A3B shape (8 layers) for the rows without Liger (PEFT, Unsloth),
# checkpointing off first, then on (tags moe-ckpt-off, moe-ckpt-on; MOE_ROWS overrides the rows, e.g. to add
# peft-eager-experts); moe-off / moe-on run one mode each; moe-liger: loralei's rows with Liger's RMSNorm / RoPE
# (loralei-fused: Liger's fused linear cross entropy too; loralei-fused-lce: loralei's own), both modes, one table
# (tag moe-loralei-liger-N for the N-th moe-liger part of the call: give it before and after moe to see the
# machine drift across the Unsloth rows; MOE_LIGER_ROWS overrides its rows); moe-profile: the expert time split of each row (profile_experts.py, 2 profiled steps,
# checkpointing off; MOE_PROFILE_ROWS overrides the rows) into $out/experts. They share $moe_ckpt.
# dist-1: bench_distributed.py at the Llama-3-8B shape (fused + Liger, checkpointing on) in one plain process,
# then under torchrun --nproc_per_node 1 with DDP and with FSDP2 (NCCL), one table ($out/dist/one-gpu.md);
# dist-2: one GPU, then DDP and FSDP2 over every GPU of the machine, checkpointing off and on ($out/dist/gpus.md);
# dist-nf4: the NF4 base (loralei-nf4 + Liger) in one process, then FSDP2 over every GPU, checkpointing off and on
# ($out/dist/nf4.md).
# dist-prefetch: FSDP2 over every GPU at other forward-prefetch depths (DIST_PREFETCH, default "0 2"; 0 is FSDP2's
# own order), checkpointing DIST_CKPT (default "off on"), against dist-2's one-GPU runs ($out/dist/prefetch.md).
# dist-tests: tests/train/test_ddp.py and test_sequence_parallel.py (on two or more GPUs their runs use them, through NCCL).
# sequence-parallel: issue 50's long rows over the GPUs at the Llama-3-8B shape, for each of SP_LENGTHS (default
# 128k 256k): the runner in one process, then under torchrun with each sequence split over SP_GPUS processes
# (default: every GPU), both with checkpointing on and without CUDA graphs, one timed step (after one warm-up
# step below 256K; $out/sp-1gpu-LEN.json, $out/sp-NGPUgpu-LEN.json), all from /tmp/bench-ckpt-llama3-8b-long;
# then the table against one GPU (sequence_parallel_table.py: $out/sequence-parallel.md). About 2 minutes at
# 128K and 5 at 256K on H200s: give one length per call where the 600 s limit is near.
# bench_runner.py loads each shape's random-weight checkpoint from /tmp/bench-ckpt-SHAPE (the QLoRA parts' $ckpt at
# the 8B shape), written by the call's first run that needs it.
# runner-default: bench_runner.py, the runner itself with its defaults, at the Llama-3-8B and Qwen3-0.6B shapes,
# checkpointing off, on and offloaded ($out/runner-SHAPE-MODE.json); RUNNER_SHAPES and RUNNER_MODES override the
# shapes and modes, RUNNER_FLAGS adds bench_runner flags (--compile, --no-liger), RUNNER_TAG ends the file names;
# RUNNER_PROFILE=1 profiles one more step after the timed ones (bench_runner --profile: kernel categories, top
# kernels, wall and GPU busy ms, top CPU ops, host syncs) into $out/profile-runner-SHAPE-MODE${RUNNER_TAG}.json
# and prints its summary.
# peers: the Unsloth bf16 row at PEER_SHAPES (default llama3-8b qwen3-0.6b), checkpointing off and on, in its own
# process; with PEER_PEFT set (to "--liger" for PEFT + Liger, or " " for plain PEFT) the PEFT bf16-adapter row too.
# memory: memory_step.py, where the runner's training step puts its peak memory by category (weights, optimizer
# state, gradients, saved activations per layer and by module, loss/logits, the rest), at the Llama-3-8B shape,
# checkpointing off, on and offloaded ($out/memory-llama3-8b-MODE.json; the table is printed).
# checkpoint-dequant: bench_checkpoint_dequant.py (the GPTQ / AWQ / NVFP4 dequantization kernels against the torch
# unpacking and NF4's kernel at the 8B projection shapes, bit identity checked; $out/checkpoint-dequant.json).
# fp8: bench_fp8.py (FP8 against bf16 GEMMs at the 8B projection shapes and the joint input gradients, and
# torch._scaled_mm against loralei's Triton FP8 GEMM: ms, TFLOP/s, relative error; $out/fp8-gemm.json), the runner with an FP8 base at the 8B shape, checkpointing off and on
# ($out/runner-llama3-8b-MODE-fp8.json; give `peers` in the same call for the Unsloth rows), then fp8_accuracy.py
# (logits at the 8B shape, FP8_SEEDS quickstart runs of 300 steps per base, default 16, FP8_JOBS at a time, default
# 8; $out/fp8-accuracy.json).
# bar: issue 12's bar call, per shape in BAR_SHAPES (default llama3-8b qwen3-0.6b): the runner with its defaults
# in the checkpointing modes BAR_MODES (default off offload on), then the peers BAR_PEERS (default unsloth
# peft-liger peft: Unsloth bf16, PEFT bf16 adapters with and without Liger; axolotl, Axolotl's LoRA kernels, may
# be added; checkpointing off and on), each in
# its own process, all in this call; 2 warm-up + 5 timed steps at 8B, 3 + 20 at Qwen3-0.6B (a 0.15 s step);
# files $out/bar-SHAPE-*.json.
# moe-bar: issue 44's MoE call: the runner with its defaults at the Qwen3-30B-A3B shape (8 layers), checkpointing
# off, on and offloaded, each with one profiled step after the timed ones ($out/moe-bar-runner-MODE.json,
# $out/profile-moe-bar-MODE.json), then Unsloth bf16 with checkpointing off and on (moe-ckpt-off, moe-ckpt-on);
# every run loads $moe_ckpt.
# fp8-bar: issue 44's FP8 call at the Llama-3-8B shape: Unsloth's FP8 LoRA (load_in_fp8=True), checkpointing off and
# on (PEER_CHECKPOINTING=off or on for one of them; tag fp8-bar-unsloth), then the runner with an FP8 base in FP8_MODES (default off on offload;
# $out/fp8-bar-runner-MODE.json, each with one profiled step after the timed ones in $out/profile-fp8-bar-MODE.json);
# every run loads $ckpt.
# nf4-bar: issue 44's NF4 call at the Llama-3-8B shape: Unsloth 4-bit, checkpointing off and on (its offloading;
# tag nf4-bar-unsloth; PEER_CHECKPOINTING as fp8-bar's), then the runner with an NF4 base in NF4_MODES (default off offload;
# $out/nf4-bar-runner-MODE.json, profiled as fp8-bar's); every run loads $ckpt.
# kept-short: an A/B of attention results and q/k/v/o outputs kept in host memory at the 8B shape's 8K-token
# batches (the runner keeps them from 32K-token rows): the runner with offloaded checkpointing as it is, then with
# --keep-attention-from 1, each with a profiled step ($out/kept-short-{default,kept}.json); both load $ckpt.
# dora-bar: issue 49's DoRA bar at the Llama-3-8B shape: the runner with its defaults, then with lora.use_dora, in
# DORA_MODES (default off on; $out/dora-bar-{lora,dora}-MODE.json, each with a profiled step in
# $out/profile-dora-bar-{lora,dora}-MODE.json, kernel by kernel side by side; DORA_PROFILE=0: none); DORA_PROBES
# ("NAME ARGS...;..."): DoRA rows without checkpointing with more bench_runner flags ($out/dora-bar-probe-NAME.json,
# profiled); then PEFT's DoRA (bf16 adapters) and Axolotl's DoRA kernels on it (a child process), checkpointing
# off and on (tag dora-bar-peft; DORA_PEERS overrides those rows, empty: none; DORA_PEER_MODES their checkpointing:
# off, on or both, the default); every run loads $ckpt.
# nvfp4-bar: issue 47's NVFP4 rows: the runner on an NF4 base, then on a ModelOpt NVFP4 checkpoint of the same shape
# (nvfp4_checkpoint.py, random codes; written once to /tmp/bench-ckpt-SHAPE-nvfp4), for each SHAPE:MODE of
# NVFP4_RUNS (default: the Qwen3-30B-A3B shape, 8 layers, checkpointing off and offloaded; Llama-3-8B off);
# $out/nvfp4-bar-SHAPE-{nf4,nvfp4}-MODE.json.
# gptq-bar: issue 47's GPTQ bar at the Llama-3-8B shape: the runner on an NF4 base, then on a GPTQ copy of $ckpt
# (gptq_checkpoint.py, written once beside it as $ckpt-gptq), in GPTQ_MODES (default off offload), each with a
# profiled step ($out/gptq-bar-{nf4,gptq}-MODE.json, $out/profile-gptq-bar-*.json); then the peer, PEFT LoRA on
# that GPTQ copy (bench_train_step's peft-gptq, 2 + 5 steps), checkpointing off and on (tag gptq-bar-peft).
# stream-bar: issue 46's 8B bar: the runner with offloaded checkpointing at the Llama-3-8B shape, then the same with
# its layers' weights streamed from host memory under a STREAM_CAP_GIB (default 10) device cap for the whole run
# ($out/stream-bar-{uncapped,streamed}.json, each with a profiled step); both load $ckpt.
# stream-bar-70b: issue 46's 70B bar: the runner on an NF4 base with offloaded checkpointing at the Llama-3-70B
# shape, its random weights made and packed one layer at a time (--random-layers: the dense checkpoint does not fit
# the disk), first resident, then streamed from host memory under a STREAM_CAP_70B_GIB (default 24) device cap
# ($out/stream-bar-70b-{resident,streamed}.json, each with a profiled step); STREAM_STEPS timed steps (default 3).
# long-context: issue 45's memory slope at the Llama-3-8B shape, one row of LONG_LENGTHS (default 32k 64k 128k)
# tokens: the runner with offloaded checkpointing ($out/long-runner-LEN.json, and one more step profiled after the
# timed ones, unless LONG_PROFILE=0: $out/profile-long-runner-LEN.json), then Unsloth bf16 with its offloaded
# checkpointing (tag long-unsloth-LEN), LONG_TIMED timed steps each (default 2) after the warm-up (the runner's
# LONG_WARMUP, default two, which a row with CUDA graphs needs: its second step captures the graph; at 32K tokens
# and more graphs are off and one is enough; Unsloth's one: it compiles), then one runner step at LONG_STEP (default
# 256k; the run's first step, timed without warm-up and without graphs: $out/long-runner-step.json) and the same
# sequence's step with the MLPs untiled ($out/long-runner-step-untiled.json: the tiles' loss checked at that
# length; LONG_TILINGS=tiled or untiled runs one of the two, to split them over two device calls); an empty
# LONG_STEP, LONG_LENGTHS or LONG_MEMORY skips it;
# every run loads /tmp/bench-ckpt-llama3-8b-long. Then the runner's step memory by category at LONG_MEMORY (default
# 32k 128k; memory_step.py, $out/long-memory-LEN.json, with what is alive at the step's peak by the code that
# allocated it), and the slopes (long_context_slope.py: $out/long-context.md; split by those sites where two
# memory rows are there).
# dpo: issue 48's DPO bar at the Llama-3-8B shape, 4 pairs × 2 × 1024 tokens a step (bench_dpo.py): the runner's DPO
# path (loralei), TRL DPOTrainer + PEFT with Liger's layer kernels (trl-peft), Unsloth under TRL (unsloth), each
# row and checkpointing mode (DPO_MODES, default off on offload; offload: the runner alone, judged against the
# peers' on) in its own process, 2 warm-up + 5 timed steps, all loading
# $ckpt; files $out/dpo-ROW-MODE.json, and after each mode the table with the bar's verdict ($out/dpo.md).
# DPO_ROWS overrides the rows. DPO_OBJECTIVES (default dpo) may name simpo too: SimPO's rows (TRL's CPOTrainer with
# loss_type simpo as the trl-peft row; files $out/simpo-ROW-MODE.json and $out/simpo.md, no bar). DPO_PROFILE=1
# profiles one more step of each loralei row ($out/profile-OBJECTIVE-MODE.json).
# dpo-graphs: DPO at the Qwen3-0.6B shape (a step the host bounds when launched eagerly), checkpointing off, 4
# pairs × 2 × 1024 tokens: the runner eager (cuda_graphs: false) and replaying CUDA graphs (pad_to_max_length: true,
# which auto asks for), then TRL DPOTrainer + PEFT (trl-peft) and Unsloth under TRL (unsloth); files
# $out/dpo-qwen-ROW.json, from
# /tmp/bench-ckpt-qwen3-0.6b.
# dpo-variants: the runner's DPO row (checkpointing DPO_VARIANT_MODE, default off) plain and with one more preference
# setting each (DPO_VARIANTS, default: plain share_prompt=false ld_alpha=0.5 use_weighting=true
# precompute_reference=true; the prompts run twice, LD-DPO's weighting, WPO's extra head pass, the reference before
# the first step); files $out/dpo-variant-KEY.json. Time on an H200, about 7 minutes: $ckpt written once when missing (~1.5 min, 16 GB),
# then per process ~15 s of imports and loading and 7 steps of 1-2.5 s (Unsloth's first step compiles, ~30 s).
# shared-gathers: the shared-prompt attention's gathers at the DPO bar's batch, their backward as torch's
# index_select's and as the gather_sum kernel ($out/shared-gathers.json; seconds).
# gpu-tests: only the GPU-marked tests ($out/gpu-tests.txt; GPU_TESTS: the test paths, default tests); tests: the
# whole suite, GPU-marked included.
# At the end every profile-*.json gets its printed summary beside it (.txt), and since a device call brings back at
# most 8 files of 16 MiB, more files than that go back as one archive, $out/results.tar.gz (in pieces of 15 MiB,
# results.tar.gz.part-aa, -ab, ..., where it is larger, RESULTS_PIECE_BYTES for another size: cat them together to
# unpack).
set -uo pipefail
out=${1:?output dir}; shift
parts=${*:-tests plain liger}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  # pypcre (gptqmodel imports it) travels as an sdist: built here, against the system's libpcre2-8.so.0, with the
  # carried setuptools (fetch_wheels.sh's gptq group says why)
  for sdist in .whl/src/pypcre-*.tar.gz; do
    [ -e "$sdist" ] || continue
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/pcre-build .whl/src/setuptools-*.whl
    PYTHONPATH=/tmp/pcre-build python3 -m pip wheel -q --no-deps --no-index --no-build-isolation -w /tmp/pcre-wheel \
      "$sdist" && python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site \
      /tmp/pcre-wheel/pypcre-*.whl
  done
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
ckpt=/tmp/bench-ckpt-llama3-8b
qlora_rows="peft-bf16-adapters peft-bnb-nf4 unsloth-4bit unsloth-bf16 loralei-nf4 loralei-nf4-triton loralei-int4"
moe_ckpt=/tmp/bench-ckpt-qwen3-30b-a3b-8l
moe_rows=${MOE_ROWS:-peft-bf16-adapters unsloth-bf16}
quiet() { grep -v "^Fusion\|^loralei fusion\|^Loading weights\|^Writing model shards\|it/s\]$" | tail -60; }
qlora() {  # $1: checkpointing mode (on/off); the issue's protocol: 2 warm-up and 5 timed steps
  python3 benchmarks/bench_train_step.py --shape llama3-8b --rows $qlora_rows --checkpointing "$1" \
    --steps 5 --warmup 2 --no-ops --checkpoint-dir $ckpt --out-dir "$out" --tag "qlora-ckpt-$1" 2>&1 | quiet
}
moe() {  # $1: checkpointing mode (off/on); Unsloth's first warm-up step compiles (about 50 s), untimed
  python3 benchmarks/bench_train_step.py --shape qwen3-30b-a3b-8l --rows $moe_rows --checkpointing "$1" \
    --steps 5 --warmup 2 --no-ops --checkpoint-dir $moe_ckpt --out-dir "$out" --tag "moe-ckpt-$1" 2>&1 | quiet
}
dist() {  # $1: processes (0: one plain process), $2: mode, $3: on/off (checkpointing), $4: baseline JSON or "",
  # $5: the row (default loralei-fused), $6: an FSDP2 forward-prefetch depth (default: the library's)
  local row=${5:-loralei-fused}
  local name=$out/dist/$row-$2-$1gpu-ckpt-$3${6:+-prefetch-$6}.json runner=(python3) extra=(--row "$row")
  [ -n "${6:-}" ] && extra+=(--forward-prefetch "$6")
  [ "$1" -gt 0 ] && runner=(python3 -m torch.distributed.run --standalone --nproc_per_node "$1")
  [ "$3" = on ] && extra+=(--checkpointing)
  [ -n "$4" ] && extra+=(--baseline "$4")
  "${runner[@]}" benchmarks/bench_distributed.py --shape llama3-8b --liger --distributed "$2" "${extra[@]}" \
    --out "$name" 2>&1 | quiet
  [ -f "$name" ] && dist_runs+=("$name")
}
quantized_bar() {  # $1: quantization_type, $2: Unsloth's row, $3: the runner's checkpointing modes; 2 + 5 steps,
  # then two profiled back to back (the device gaps between them show whether the GPU waits for the host there)
  python3 benchmarks/bench_train_step.py --shape llama3-8b --rows "$2" --checkpointing "${PEER_CHECKPOINTING:-both}" --steps 5 --warmup 2 \
    --no-ops --checkpoint-dir $ckpt --out-dir "$out" --tag "$1-bar-unsloth" 2>&1 | quiet
  for mode in $3; do
    python3 benchmarks/bench_runner.py --shape llama3-8b --checkpointing $mode --quantize "$1" \
      --model-dir $ckpt --profile "$out/profile-$1-bar-$mode.json" --profile-steps 2 \
      --out "$out/$1-bar-runner-$mode.json" 2>&1 \
      | grep '"tokens_per_s"\|"peak_gib"\|profiled step\|Error' || true  # the JSON file is the result
  done
}
profiled_runs() {  # $1: the files' tag, $2: bench_runner's arguments for every run, then one "NAME ARGS..." a run:
  # each run with a profiled step after its timed ones ($out/TAG-NAME.json, $out/profile-TAG-NAME.json)
  local tag=$1 common=$2 run name
  shift 2
  for run in "$@"; do
    set -- $run; name=$1; shift
    python3 benchmarks/bench_runner.py $common "$@" --profile "$out/profile-$tag-$name.json" \
      --out "$out/$tag-$name.json" 2>&1 | grep '"tokens_per_s"\|"peak_gib"\|"host_peak_gib"\|"offload_host_gib"\|profiled step\|host-to-device\|Error' || true
  done
}
gpus=$(nvidia-smi -L | wc -l)
dist_runs=()
liger_runs=0
for part in $parts; do
  case $part in
    tests) python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests 2>&1 | tail -15 | tee "$out/tests.txt" ;;
    fp8) python3 benchmarks/bench_fp8.py --out "$out/fp8-gemm.json" 2>&1 | tail -13
         for mode in off on; do
           python3 benchmarks/bench_runner.py --shape llama3-8b --checkpointing $mode --quantize fp8 \
             --model-dir $ckpt --out "$out/runner-llama3-8b-$mode-fp8.json" 2>&1 | grep '"tokens_per_s"\|"peak_gib"\|Error'
         done
         python3 benchmarks/fp8_accuracy.py --seeds "${FP8_SEEDS:-16}" --jobs "${FP8_JOBS:-8}" \
           --out "$out/fp8-accuracy.json" 2>&1 | grep -v "training:" | tail -6 ;;
    checkpoint-dequant) python3 benchmarks/bench_checkpoint_dequant.py --out "$out/checkpoint-dequant.json" 2>&1 | tail -13 ;;
    shared-gathers) python3 benchmarks/bench_shared_gathers.py --out "$out/shared-gathers.json" 2>&1 | tail -3 ;;
    gpu-tests) python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} 2>&1 | tail -15 | tee "$out/gpu-tests.txt" ;;
    plain) python3 benchmarks/bench_train_step.py --shape llama3-8b qwen3-0.6b --out-dir "$out" --tag plain 2>&1 \
             | grep -v "^Fusion\|^  " | tail -30 ;;
    liger) python3 benchmarks/bench_train_step.py --shape llama3-8b qwen3-0.6b --liger --no-ops \
             --rows peft-default peft-bf16-adapters loralei-fused --out-dir "$out" --tag liger 2>&1 | tail -20 ;;
    profile) for row in peft-bf16-adapters loralei-fused; do
               python3 benchmarks/profile_step.py --liger --row $row --out "$out/profile-$row.json" 2>&1 | tail -40
             done ;;
    runner) for extra in "training.fused_lora=true" "training.torch_compile=true"; do  # the defaults, then compiled
              python3 -m loralei.cli examples/quickstart.yaml model.dtype=bfloat16 training.max_steps=60 \
                optimizer.warmup_steps=5 training.logging_steps=20 $extra output_dir=/tmp/qs 2>&1 \
                | grep -v "training:" | tail -8
            done ;;
    qlora) qlora on; qlora off ;;
    qlora-on) qlora on ;;
    qlora-off) qlora off ;;
    qlora-liger) python3 benchmarks/bench_train_step.py --shape llama3-8b --liger --checkpointing both \
                   --rows peft-bf16-adapters peft-bnb-nf4 loralei-nf4 --steps 5 --warmup 2 --no-ops \
                   --checkpoint-dir $ckpt --out-dir "$out" --tag qlora-liger 2>&1 | quiet ;;
    moe) moe off; moe on ;;
    moe-off) moe off ;;
    moe-on) moe on ;;
    moe-liger) liger_runs=$((liger_runs + 1))
               python3 benchmarks/bench_train_step.py --shape qwen3-30b-a3b-8l --liger --checkpointing both \
                 --rows ${MOE_LIGER_ROWS:-loralei-fused loralei-fused-lce} --steps 5 --warmup 2 --no-ops \
                 --checkpoint-dir $moe_ckpt --out-dir "$out" --tag moe-loralei-liger-$liger_runs 2>&1 | quiet ;;
    moe-profile) for row in ${MOE_PROFILE_ROWS:-unsloth-bf16 loralei-fused-lce}; do
                   liger=""; case $row in loralei*) liger=--liger ;; esac
                   python3 benchmarks/profile_experts.py --shape qwen3-30b-a3b-8l --row $row --steps 2 --warmup 2 $liger \
                     --checkpoint-dir $moe_ckpt --out "$out/experts" 2>&1 | quiet
                 done ;;
    dist-1) mkdir -p "$out/dist"; nvidia-smi topo -m > "$out/dist/topology.txt"; dist_runs=()
            dist 0 none on ""
            for mode in ddp fsdp2; do dist 1 $mode on "$out/dist/loralei-fused-none-0gpu-ckpt-on.json"; done
            python3 benchmarks/bench_distributed.py --summary "${dist_runs[@]}" --out "$out/dist/one-gpu.md" ;;
    dist-2) mkdir -p "$out/dist"; nvidia-smi topo -m > "$out/dist/topology.txt"; dist_runs=()
            for ckpt in off on; do
              base=$out/dist/loralei-fused-none-0gpu-ckpt-$ckpt.json  # dist-1's, when it ran first
              if [ -f "$base" ]; then dist_runs+=("$base"); else dist 0 none $ckpt ""; fi
              for mode in ddp fsdp2; do dist "$gpus" $mode $ckpt "$base"; done
            done
            python3 benchmarks/bench_distributed.py --summary "${dist_runs[@]}" --out "$out/dist/gpus.md" ;;
    runner-default) for shape in ${RUNNER_SHAPES:-llama3-8b qwen3-0.6b}; do for mode in ${RUNNER_MODES:-off on offload}; do
                      name=runner-$shape-$mode${RUNNER_TAG:-}; profile=$out/profile-$name.json; prof=()
                      [ "${RUNNER_PROFILE:-}" = 1 ] && prof=(--profile "$profile") && rm -f "$profile"
                      python3 benchmarks/bench_runner.py --shape $shape --checkpointing $mode ${RUNNER_FLAGS:-} "${prof[@]}" \
                        --model-dir /tmp/bench-ckpt-$shape --out "$out/$name.json" 2>&1 | grep '"tokens_per_s"\|"peak_gib"\|Error'
                      [ ${#prof[@]} -gt 0 ] && [ -f "$profile" ] && python3 benchmarks/profile_summary.py "$profile"
                    done; done ;;
    peers) for shape in ${PEER_SHAPES:-llama3-8b qwen3-0.6b}; do
             python3 benchmarks/bench_train_step.py --shape $shape --rows unsloth-bf16 --checkpointing both \
               --steps 5 --warmup 2 --no-ops --out-dir "$out" --tag peers-unsloth-$shape 2>&1 | quiet
             [ -n "${PEER_PEFT:-}" ] && python3 benchmarks/bench_train_step.py --shape $shape --rows peft-bf16-adapters \
               --checkpointing both --steps 5 --warmup 2 --no-ops --out-dir "$out" --tag peers-peft-$shape $PEER_PEFT 2>&1 | quiet
           done ;;
    bar) for shape in ${BAR_SHAPES:-llama3-8b qwen3-0.6b}; do
           steps=(--steps 5 --warmup 2); [ "$shape" = qwen3-0.6b ] && steps=(--steps 20 --warmup 3)
           for mode in ${BAR_MODES:-off offload on}; do
             python3 benchmarks/bench_runner.py --shape $shape --checkpointing $mode "${steps[@]}" \
               --model-dir /tmp/bench-ckpt-$shape --out "$out/bar-$shape-runner-$mode.json" 2>&1 | grep '"tokens_per_s"\|"peak_gib"\|Error'
           done
           for peer in ${BAR_PEERS:-unsloth peft-liger peft}; do
             rows=(--rows peft-bf16-adapters); [ $peer = unsloth ] && rows=(--rows unsloth-bf16)
             [ $peer = axolotl ] && rows=(--rows axolotl-lora)
             [ $peer = peft-liger ] && rows+=(--liger)
             python3 benchmarks/bench_train_step.py --shape $shape "${rows[@]}" --checkpointing both "${steps[@]}" \
               --no-ops --out-dir "$out" --tag bar-$shape-$peer 2>&1 | quiet
           done
         done ;;
    long-context) long_ckpt=/tmp/bench-ckpt-llama3-8b-long
                  for len in ${LONG_LENGTHS-32k 64k 128k}; do
                    profile=(--profile "$out/profile-long-runner-$len.json"); [ "${LONG_PROFILE:-1}" = 0 ] && profile=()
                    python3 benchmarks/bench_runner.py --shape llama3-8b-$len --checkpointing offload \
                      --steps ${LONG_TIMED:-2} --warmup ${LONG_WARMUP:-2} --model-dir $long_ckpt \
                      --out "$out/long-runner-$len.json" "${profile[@]}" 2>&1 | grep '"tokens_per_s"\|"peak_gib"\|Error'
                    python3 benchmarks/bench_train_step.py --shape llama3-8b-$len --rows unsloth-bf16 --checkpointing on \
                      --steps ${LONG_TIMED:-2} --warmup 1 --no-ops --checkpoint-dir $long_ckpt --out-dir "$out" \
                      --tag long-unsloth-$len 2>&1 | quiet
                  done
                  for len in ${LONG_STEP-256k}; do
                    for tiling in ${LONG_TILINGS:-tiled untiled}; do
                      flag=(); name=long-runner-step; [ $tiling = untiled ] && flag=(--no-tiled-mlp) && name+=-untiled
                      python3 benchmarks/bench_runner.py --shape llama3-8b-$len --checkpointing offload --no-cuda-graphs \
                        --steps 1 --warmup 0 "${flag[@]}" --model-dir $long_ckpt --out "$out/$name.json" 2>&1 \
                        | grep '"tokens_per_s"\|"peak_gib"\|"last_loss"\|Error' || true
                    done
                  done
                  for len in ${LONG_MEMORY-32k 128k}; do
                    python3 benchmarks/memory_step.py --shape llama3-8b-$len --checkpointing offload --snapshot \
                      --out "$out/long-memory-$len.json" 2>&1 | tail -25
                  done
                  python3 benchmarks/long_context_slope.py "$out" --out "$out/long-context.md" ;;
    moe-bar) for mode in off on offload; do
               python3 benchmarks/bench_runner.py --shape qwen3-30b-a3b-8l --checkpointing $mode --model-dir $moe_ckpt \
                 --profile "$out/profile-moe-bar-$mode.json" --out "$out/moe-bar-runner-$mode.json" 2>&1 \
                 | grep '"tokens_per_s"\|"peak_gib"\|profiled step\|Error'
             done
             moe_rows=unsloth-bf16; moe off; moe on ;;
    fp8-bar) quantized_bar fp8 unsloth-fp8 "${FP8_MODES:-off on offload}" ;;
    stream-bar) profiled_runs stream-bar "--shape llama3-8b --checkpointing offload --model-dir $ckpt" "uncapped" \
                  "streamed --layer-offloading --memory-cap-gib ${STREAM_CAP_GIB:-10}" ;;
    stream-bar-70b) profiled_runs stream-bar-70b \
                      "--shape llama3-70b --quantize nf4 --checkpointing offload --random-layers --steps ${STREAM_STEPS:-3}" \
                      "resident" "streamed --layer-offloading --memory-cap-gib ${STREAM_CAP_70B_GIB:-24}" ;;
    nf4-bar) quantized_bar nf4 unsloth-4bit "${NF4_MODES:-off offload}" ;;
    kept-short) profiled_runs kept-short "--shape llama3-8b --checkpointing offload --model-dir $ckpt" "default" \
                  "kept --keep-attention-from 1" ;;
    dora-bar) for mode in ${DORA_MODES:-off on}; do
                if [ "${DORA_PROFILE:-1}" = 1 ]; then
                  profiled_runs dora-bar "--shape llama3-8b --checkpointing $mode --model-dir $ckpt" "lora-$mode" \
                    "dora-$mode --dora"
                else
                  for run in "lora-$mode" "dora-$mode --dora"; do
                    set -- $run; name=$1; shift
                    python3 benchmarks/bench_runner.py --shape llama3-8b --checkpointing $mode --model-dir $ckpt "$@" \
                      --out "$out/dora-bar-$name.json" 2>&1 | grep '"tokens_per_s"\|"peak_gib"\|Error' || true
                  done
                fi
              done
              if [ -n "${DORA_PROBES:-}" ]; then  # "NAME ARGS...;NAME ARGS...": probe rows of the stash, checkpointing off
                IFS=';' read -ra probes <<< "$DORA_PROBES"
                for probe in "${probes[@]}"; do
                  profiled_runs dora-bar "--shape llama3-8b --checkpointing off --model-dir $ckpt --dora" "probe-$probe"
                done
              fi
              peers=${DORA_PEERS-peft-dora axolotl-dora}
              [ -z "$peers" ] || python3 benchmarks/bench_train_step.py --shape llama3-8b --rows $peers --checkpointing ${DORA_PEER_MODES:-both} \
                --steps 5 --warmup 2 --no-ops --checkpoint-dir $ckpt --out-dir "$out" --tag dora-bar-peft 2>&1 | quiet ;;
    nvfp4-bar) for run in ${NVFP4_RUNS:-qwen3-30b-a3b-8l:off qwen3-30b-a3b-8l:offload llama3-8b:off}; do
                 shape=${run%:*}; mode=${run#*:}
                 for base in "nf4 --quantize nf4 --model-dir /tmp/bench-ckpt-$shape" \
                             "nvfp4 --nvfp4-checkpoint --model-dir /tmp/bench-ckpt-$shape-nvfp4"; do
                   set -- $base; name=$1; shift
                   python3 benchmarks/bench_runner.py --shape $shape --checkpointing $mode "$@" \
                     --out "$out/nvfp4-bar-$shape-$name-$mode.json" 2>&1 | grep '"tokens_per_s"\|"peak_gib"\|Error' || true
                 done
               done ;;
    gptq-bar) for mode in ${GPTQ_MODES:-off offload}; do
                profiled_runs gptq-bar "--shape llama3-8b --checkpointing $mode --model-dir $ckpt" \
                  "nf4-$mode --quantize nf4" "gptq-$mode --gptq"
              done
              python3 benchmarks/bench_train_step.py --shape llama3-8b --rows peft-gptq --checkpointing both \
                --steps 5 --warmup 2 --no-ops --checkpoint-dir $ckpt --out-dir "$out" --tag gptq-bar-peft 2>&1 | quiet ;;
    dpo) for objective in ${DPO_OBJECTIVES:-dpo}; do
           for mode in ${DPO_MODES:-off on offload}; do
             rows=${DPO_ROWS:-loralei trl-peft unsloth}; [ $mode = offload ] && rows=loralei
             for row in $rows; do
               profile=(); [ "${DPO_PROFILE:-0}" = 1 ] && [ $row = loralei ] \
                 && profile=(--profile "$out/profile-$objective-$mode.json")
               HF_HUB_OFFLINE=1 python3 benchmarks/bench_dpo.py --row $row --objective $objective --checkpointing $mode \
                 --model-dir $ckpt "${profile[@]}" --out "$out/$objective-$row-$mode.json" 2>&1 \
                 | grep '"tokens_per_s"\|"peak_gib"\|"error"\|Error\|profiled step' || true
             done
             python3 benchmarks/bench_dpo.py --summary "$out"/$objective-*-*.json --out "$out/$objective.md"
           done
         done ;;
    dpo-graphs) for run in "loralei-eager --training cuda_graphs=false" "loralei-graphed --training pad_to_max_length=true" \
                           "trl-peft --row trl-peft" "unsloth --row unsloth"; do
                  set -- $run; name=$1; shift
                  HF_HUB_OFFLINE=1 python3 benchmarks/bench_dpo.py --shape qwen3-0.6b --checkpointing off "$@" \
                    --model-dir /tmp/bench-ckpt-qwen3-0.6b --out "$out/dpo-qwen-$name.json" 2>&1 \
                    | grep '"tokens_per_s"\|"peak_gib"\|"error"\|Error' || true
                done ;;
    dpo-variants) for variant in ${DPO_VARIANTS:-plain share_prompt=false ld_alpha=0.5 use_weighting=true precompute_reference=true}; do
                    extra=(); [ $variant = plain ] || extra=(--preference "$variant")
                    HF_HUB_OFFLINE=1 python3 benchmarks/bench_dpo.py --checkpointing ${DPO_VARIANT_MODE:-off} \
                      --model-dir $ckpt "${extra[@]}" --out "$out/dpo-variant-${variant%%=*}.json" 2>&1 \
                      | grep '"tokens_per_s"\|"peak_gib"\|"error"\|Error' || true
                  done ;;
    memory) for mode in off on offload; do
              python3 benchmarks/memory_step.py --shape llama3-8b --checkpointing $mode \
                --out "$out/memory-llama3-8b-$mode.json" 2>&1 | tail -25
            done ;;
    dist-prefetch) mkdir -p "$out/dist"; dist_runs=()
                   for ckpt in ${DIST_CKPT:-off on}; do
                     base=$out/dist/loralei-fused-none-0gpu-ckpt-$ckpt.json  # dist-2's, when it ran first
                     [ -f "$base" ] || dist 0 none $ckpt ""
                     for depth in ${DIST_PREFETCH:-0 2}; do dist "$gpus" fsdp2 $ckpt "$base" "" $depth; done
                   done
                   python3 benchmarks/bench_distributed.py --summary "${dist_runs[@]}" --out "$out/dist/prefetch.md" ;;
    dist-nf4) mkdir -p "$out/dist"; dist_runs=()
              for ckpt in off on; do
                dist 0 none $ckpt "" loralei-nf4
                dist "$gpus" fsdp2 $ckpt "$out/dist/loralei-nf4-none-0gpu-ckpt-$ckpt.json" loralei-nf4
              done
              python3 benchmarks/bench_distributed.py --summary "${dist_runs[@]}" --out "$out/dist/nf4.md" ;;
    sequence-parallel) sp_gpus=${SP_GPUS:-$gpus}; long_ckpt=/tmp/bench-ckpt-llama3-8b-long; sp_runs=()
                       if [ "$sp_gpus" -lt 2 ]; then echo "sequence-parallel: needs two or more GPUs, $sp_gpus here"; continue; fi
                       for len in ${SP_LENGTHS:-128k 256k}; do
                         steps=(--steps 1 --warmup 1); [ "$len" = 256k ] && steps=(--steps 1 --warmup 0)
                         common=(--shape llama3-8b-$len --checkpointing on --no-cuda-graphs "${steps[@]}" --model-dir $long_ckpt)
                         python3 benchmarks/bench_runner.py "${common[@]}" --out "$out/sp-1gpu-$len.json" 2>&1 \
                           | grep '"tokens_per_s"\|"peak_gib"\|"last_loss"\|Error' || true
                         python3 -m torch.distributed.run --standalone --nproc_per_node "$sp_gpus" benchmarks/bench_runner.py \
                           "${common[@]}" --sequence-parallel "$sp_gpus" --out "$out/sp-${sp_gpus}gpu-$len.json" 2>&1 \
                           | grep '"tokens_per_s"\|"peak_gib"\|"last_loss"\|Error' || true
                         sp_runs+=("$out/sp-1gpu-$len.json" "$out/sp-${sp_gpus}gpu-$len.json")
                       done
                       present=(); for run in "${sp_runs[@]}"; do [ -f "$run" ] && present+=("$run"); done
                       [ ${#present[@]} -gt 0 ] && python3 benchmarks/sequence_parallel_table.py "${present[@]}" \
                         --out "$out/sequence-parallel.md" ;;
    dist-tests) python3 -m pytest -q -p no:cacheprovider tests/train/test_ddp.py tests/train/test_sequence_parallel.py 2>&1 | tail -30 \
                  | tee "$out/dist-tests.txt" ;;
  esac
done
for profile in "$out"/profile-*.json; do
  [ -e "$profile" ] && python3 benchmarks/profile_summary.py "$profile" > "${profile%.json}.txt" 2>&1
done
if [ "$(find "$out" -type f | wc -l)" -gt 8 ]; then
  archive=$(mktemp -d)/results.tar.gz
  tar czf "$archive" -C "$out" . && find "$out" -mindepth 1 -delete && mv "$archive" "$out/"
  piece=${RESULTS_PIECE_BYTES:-$((15 << 20))}
  if [ "$(stat -c %s "$out/results.tar.gz")" -gt "$piece" ]; then
    split -b "$piece" "$out/results.tar.gz" "$out/results.tar.gz.part-" && rm "$out/results.tar.gz"
  fi
fi
