#!/usr/bin/env bash
# Multi-LoRA on the H200 in one device call: the Triton kernels' tests compiled on the GPU, the end-to-end
# check against HF merged adapters, the kernels' timings, and the 8B-shaped throughput against the base.
# Usage (repo root, on the device): benchmarks/nvidia_h200_lora.sh OUT_DIR
OUT=$1
source benchmarks/nvidia_h200_setup.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_lora_kernels.py 2>&1 | tail -4
(cd benchmarks && timeout 150 python3 lora_gpu_check.py --device cuda --tokenizer ../.nvcarry/llama3-8b-dummy 2>&1 | grep -v Warn | tail -3)
timeout 100 python3 benchmarks/lora_kernel_bench.py 2>&1 | tee $OUT/lora_kernel_bench.txt | tail -18
timeout 300 python3 benchmarks/lora_throughput.py --model .nvcarry/llama3-8b-dummy --load-format dummy --device cuda \
  --dtype bfloat16 --requests 256 --tokens 128 --max-num-seqs 256 --repeats 2 --out $OUT/lora_h200.json 2>&1 | grep -v -i "warn\|loading" | tail -16
