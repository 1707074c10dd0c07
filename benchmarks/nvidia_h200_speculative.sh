#!/usr/bin/env bash
# Speculative decoding on the H200 in two back-to-back device calls (the embedded GGUF, 98 MB, travels in
# two parts, each under the call's size limit, and is put together in /tmp between the calls).
# Usage (repo root, on the device):
#   benchmarks/nvidia_h200_speculative.sh check OUT   # carry .nvcarry .nvgg1: install, greedy checks, part 1
#   benchmarks/nvidia_h200_speculative.sh bench OUT   # carry .nvgg2: part 2, then the copy-heavy benchmark
STEP=$1
OUT=$2
if [ "$STEP" = check ]; then
  source benchmarks/nvidia_h200_setup.sh
  mkdir -p /tmp/gg && cp .nvgg1/part1 /tmp/gg/
  (cd benchmarks && timeout 240 python3 speculative_gpu_check.py --device cuda --tokenizer ../.nvcarry/llama3-8b-dummy 2>&1 | grep -v -i "warn\|loading\|writing" | tail -8)
else
  export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
  python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cpu -e plugins/nvidia 2>&1 | grep -v WARNING
  cat /tmp/gg/part1 .nvgg2/part2 > /tmp/gg/smollm2.gguf && sha256sum /tmp/gg/smollm2.gguf | cut -c1-16
  # the switch on (the default), then every proposal kept whatever it costs
  for variant in auto forced; do
    extra=""; [ "$variant" = forced ] && extra="--no-auto-disable"
    timeout 250 python3 benchmarks/speculative_ngram.py --model /tmp/gg/smollm2.gguf --device cuda $extra \
      --methods plain,ngram,suffix --out $OUT/speculative_h200_$variant.json 2>&1 | grep -v -i "warn\|loading" | grep -E "tok_s|speedup|ratio|switched|acceptance_rate"
  done
fi
