# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
MODEL  ?= models/dsv4-stdlib-12l
PROMPT ?= def fibonacci(n):

.PHONY: install run random-tiny test lint clean

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

# The shipped default model: a small DeepSeek-V4-architecture model trained on Python's standard library.
run: install
	$(VENV)/bin/leanserve generate --model $(MODEL) --prompt '$(PROMPT)' --max-tokens 64

# A random-weight checkpoint with every path of the architecture, for experiments and benchmarks.
random-tiny: build/random-tiny/model.safetensors
build/random-tiny/model.safetensors: | $(STAMP)
	$(VENV)/bin/leanserve make-random build/random-tiny --preset tiny --seed 0 --force

# The kernels compiled first, for every weight format in parallel processes (the tests then load them); the
# tests in one worker process per core, at most 4 (many of them wait on processes they start, or on Python alone).
test: install
	$(VENV)/bin/ruff check src train tests scripts
	$(VENV)/bin/leanserve prebuild
	$(VENV)/bin/pytest -n auto --maxprocesses 4

lint: install
	$(VENV)/bin/ruff check src train tests scripts
	$(VENV)/bin/ruff format --check src train tests scripts

clean:
	rm -rf build .pytest_cache .ruff_cache
