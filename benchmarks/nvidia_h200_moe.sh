#!/usr/bin/env bash
# The MoE issue's H200 checks in one device call: conformance rows (moe, ops), tiny MoE models against HF,
# the kernel table, batch-1 decode of a Qwen3-30B-A3B-shaped model. Usage: benchmarks/nvidia_h200_moe.sh OUT_DIR
OUT=$1; TOK=.nvcarry/llama3-8b-dummy; LOGS=/tmp/nvlogs; mkdir -p $LOGS
source benchmarks/nvidia_h200_setup.sh > $LOGS/setup.log 2>&1; tail -1 $LOGS/setup.log
timeout 100 python3 -m pytest -q -p no:cacheprovider conformance_tests/engine_conformance --device cuda \
  --capability moe --capability ops --capability gemm 2>&1 | tail -4
timeout 40 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_moe_kernels.py 2>&1 | tail -2
timeout 90 python3 benchmarks/nvidia_h200_dense.py greedy --tokenizer $TOK --json $OUT/moe_greedy.json \
  --only MixtralForCausalLM Qwen2MoeForCausalLM Qwen3MoeForCausalLM OlmoeForCausalLM 2>&1 | grep -v Warning | tail -6
timeout 150 python3 benchmarks/nvidia_h200_moe.py kernels --json $OUT/moe_kernels.json 2>&1 | tail -12
timeout 200 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $TOK --json $OUT/moe_decode.json 2>&1 | tail -4
