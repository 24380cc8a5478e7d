#!/bin/bash
# stop 74, device call B: DPO and KTO at the Qwen3-0.6B shape with the peers' corrected steps
out=$1
bash benchmarks/run_gpu.sh "$out" dpo-graphs 2>&1 | tail -20
export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site PYTHONUNBUFFERED=1
for row in loralei trl-peft unsloth; do
  HF_HUB_OFFLINE=1 python3 benchmarks/bench_dpo.py --shape qwen3-0.6b --objective kto --checkpointing off --row $row \
    --model-dir /tmp/bench-ckpt-qwen3-0.6b --out "$out/kto-qwen-$row.json" > "$out/log-kto-$row.txt" 2>&1
  grep '"tokens_per_s"\|"peak_gib"\|"error"\|Error\|Gradient accumulation' "$out/log-kto-$row.txt"
done
