# `make test` and `make demo` set up .venv on first use, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: test demo bench-smoke lint docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) examples/flax_nnx.py

bench-smoke: $(STAMP)
	$(PY) benchmarks/run.py --smoke
	$(PY) benchmarks/read_once.py --smoke

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxckpt tests examples benchmarks tools

# the site (mkdocs.yml) into build/site; strict: a broken link or docstring reference fails
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache build/site
