#!/usr/bin/env bash
# Builds .nvcarry/ (git-ignored locally), what the device calls carry: the pure-Python wheels the H200 image lacks
# (cp312, manylinux; pinned to versions whose own dependencies the image has, see ../shared/NOTES.md) and the
# Llama-3-8B-shaped dummy folder (config and tokenizer; the benchmarks draw its weights on the GPU). Run it from the
# repository root with the project's virtual environment installed (make install-test); then pass
# carry [".nvcarry"] to the device tool and `source benchmarks/nvidia_h200_setup.sh` there.
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .nvcarry/whl
grep -qx ".nvcarry/" .git/info/exclude 2>/dev/null || echo ".nvcarry/" >> .git/info/exclude
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d .nvcarry/whl \
  pydantic==2.11.9 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.1 fastapi==0.116.1 \
  starlette==0.47.3 uvicorn==0.35.0 gguf==0.19.0 importlib-metadata==8.7.0 httptools==0.6.4 xgrammar==0.2.9 \
  apache-tvm-ffi==0.1.15.post2
[ -d .nvcarry/llama3-8b-dummy ] || "$PY" benchmarks/make_dummy_llama3_8b.py .nvcarry/llama3-8b-dummy
ls .nvcarry/whl | wc -l | xargs echo "wheels:"
du -sh .nvcarry
