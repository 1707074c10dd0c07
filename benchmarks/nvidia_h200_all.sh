#!/usr/bin/env bash
# Everything the H200 report needs in one device call (bounded to fit its 10-minute limit):
# conformance, (a)+(d) batch-1 decode, (b) offline throughput vs HF, (c) serving, then the plugin tests.
# Usage (repo root, on the device): benchmarks/nvidia_h200_all.sh OUT_DIR   (logs go to /tmp/nvlogs)
OUT=$1; MODEL=.nvcarry/llama3-8b-dummy; LOGS=/tmp/nvlogs; mkdir -p $LOGS
source benchmarks/nvidia_h200_setup.sh
timeout 150 engine conformance --device cuda --report "$OUT/nvidia-h200.md" --json "$OUT/conformance.json" > $LOGS/conformance.log 2>&1
tail -45 $LOGS/conformance.log
timeout 110 python3 benchmarks/nvidia_h200.py decode --model $MODEL --json "$OUT/decode.json" > $LOGS/decode.log 2>&1
tail -16 $LOGS/decode.log
timeout 330 python3 benchmarks/nvidia_h200.py throughput --model $MODEL --json "$OUT/throughput.json" > $LOGS/throughput.log 2>&1
tail -12 $LOGS/throughput.log
timeout 110 benchmarks/nvidia_h200_serve.sh $MODEL $LOGS > $LOGS/serve_bench.log 2>&1
cp $LOGS/serve_rate_*.json "$OUT/" 2>/dev/null; grep -E "TTFT|TPOT|Request|throughput|Error|error" $LOGS/serve_bench.log | head -40; tail -5 $LOGS/serve.log
timeout 160 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests > $LOGS/plugin_tests.log 2>&1
tail -8 $LOGS/plugin_tests.log
cp $LOGS/*.log "$OUT/" 2>/dev/null
