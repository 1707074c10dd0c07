#!/usr/bin/env bash
# The decode attention kernel against an earlier commit's (BEFORE: that commit's attention_kernels.py, e.g.
# `git show REV:plugin_sdk/engine_plugin_sdk/gpu/triton_kernels/attention_kernels.py > .nvcarry/decode_kernel_before.py`)
# in one device call: the kernel tests on the GPU, the FP8 ladder (nvidia_h200_decode_kv_heads.py --ladder), then
# batch-1 bf16 decode and issue 32's offline W8A8 + FP8 KV run, before and after, alternating.
# Usage (repo root, on the device): benchmarks/nvidia_h200_decode_kernel_ab.sh OUT_DIR BEFORE [ROUNDS]
OUT=$1; BEFORE=$2; ROUNDS=${3:-1}; MODEL=.nvcarry/llama3-8b-dummy
source benchmarks/nvidia_h200_setup.sh
timeout 170 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_decode_kernel.py plugins/nvidia/tests/test_fused_decode.py plugins/nvidia/tests/test_pdl.py > "$OUT/kernel_tests.log" 2>&1
tail -1 "$OUT/kernel_tests.log"; grep -E "^E  |FAILED" "$OUT/kernel_tests.log" | head -5
timeout 150 python3 benchmarks/nvidia_h200_decode_kv_heads.py --ladder --quick --before "$BEFORE" --json "$OUT/ladder.json" 2>&1 | grep -E "ladder|Error"
for round in $(seq 1 "$ROUNDS"); do
    for which in before after; do
        from=""; [ "$which" = before ] && from="--decode-kernel-from $BEFORE"
        timeout 100 python3 benchmarks/nvidia_h200.py decode --model $MODEL $from --json "$OUT/decode_${which}_$round.json" 2>&1 \
            | grep -E "^decode_tok_s_graphs|^decode_tok_s_end_to_end|ratio_to_roofline_bytes_read|copy_bandwidth" | sed "s/^/$which: /"
    done
    for which in before after; do
        from=""; [ "$which" = before ] && from="--decode-kernel-from $BEFORE"
        timeout 120 python3 benchmarks/nvidia_h200.py throughput --model $MODEL --hf-batch --quantization fp8 \
            --kv-cache-dtype fp8 $from --json "$OUT/throughput_fp8_${which}_$round.json" 2>&1 \
            | grep -E "engine_output|sha256" | sed "s/^/fp8 $which: /"
    done
done
