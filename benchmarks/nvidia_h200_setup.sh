#!/usr/bin/env bash
# Installs the engine and the CPU/NVIDIA plugins on the H200 image (no internet there): the missing pure
# Python packages travel as wheels in .nvcarry/whl (benchmarks/make_nvcarry.sh builds it; structured output needs
# xgrammar==0.2.9 and apache-tvm-ffi==0.1.15.post2 there too; the image has uvloop but not httptools, which
# the server uses where installed). Source it.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .nvcarry/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cpu -e plugins/nvidia 2>&1 | grep -v WARNING || true
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
set +e
