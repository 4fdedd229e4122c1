# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
MODEL  ?= build/random-tiny
PROMPT ?= 1,17,42,99,7,256,3,88

.PHONY: install run test lint clean

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned to the CPU build on this machine's disk; anything that depends on torch afterwards
# finds it satisfied instead of pulling a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,train]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

$(MODEL)/model.safetensors: | $(STAMP)
	$(VENV)/bin/leanserve make-random $(MODEL) --preset tiny --seed 0 --force

run: install $(MODEL)/model.safetensors
	$(VENV)/bin/leanserve generate --model $(MODEL) --prompt-token-ids $(PROMPT) --max-tokens 32 --ignore-eos

test: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/pytest

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf build .pytest_cache .ruff_cache
