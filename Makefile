# `make test` and `make demo` set up .venv on first use, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench-smoke lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) examples/train_and_reshard.py

bench-smoke: $(STAMP)
	$(PY) benchmarks/run.py --smoke

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxckpt tests examples benchmarks tools

clean:
	rm -rf $(VENV) .pytest_cache
