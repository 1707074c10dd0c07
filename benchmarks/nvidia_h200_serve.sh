#!/usr/bin/env bash
# (c) engine serve on the dummy Llama-3-8B, then engine bench serve at request rates 8, 32 and unlimited.
# Usage: benchmarks/nvidia_h200_serve.sh MODEL_DIR OUT_DIR
MODEL=$1; OUT=$2
engine serve --device cuda --model "$MODEL" --load-format dummy --dtype bfloat16 --max-model-len 2048 \
  --max-num-seqs 256 --max-num-batched-tokens 4096 --port 8011 > "$OUT/serve.log" 2>&1 &
SERVER=$!
# python rather than curl: the device image may lack curl
for _ in $(seq 1 240); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8011/health', timeout=2)" 2>/dev/null && break
  sleep 1
done
for rate in 8 32 inf; do
  if [ "$rate" = inf ]; then R=""; N=256; else R="--request-rate $rate"; N=$((rate * 8)); fi
  engine bench serve --base-url http://127.0.0.1:8011 --num-prompts $N $R --input-len 512 --output-len 256 \
    --json "$OUT/serve_rate_$rate.json" 2>&1 | tail -14
done
kill $SERVER; wait $SERVER 2>/dev/null
