#!/usr/bin/env bash
# The FP8 options on the H200 in one device call: (b) with W8A8 projections and an FP8 KV cache, each
# alone and together, then the kernel-level comparison (benchmarks/nvidia_h200_fp8.py).
# Usage (repo root, on the device): benchmarks/nvidia_h200_fp8.sh OUT_DIR
OUT=$1; MODEL=.nvcarry/llama3-8b-dummy
source benchmarks/nvidia_h200_setup.sh
for variant in "--quantization fp8 --kv-cache-dtype fp8" "--quantization fp8" "--kv-cache-dtype fp8"; do
    name=$(echo "$variant" | tr -d '-' | tr ' ' '_')
    echo "== throughput $variant"
    timeout 110 python3 benchmarks/nvidia_h200.py throughput --model $MODEL --hf-batch $variant \
        --json "$OUT/throughput_$name.json" 2>&1 | grep -E "engine_|kv_blocks|Error|error"
done
timeout 90 python3 benchmarks/nvidia_h200_fp8.py --json "$OUT/fp8_kernels.json" 2>&1 | tail -22
timeout 100 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests > "$OUT/plugin_tests.log" 2>&1
tail -4 "$OUT/plugin_tests.log"; grep -E "^E  " "$OUT/plugin_tests.log" | head -5
