# `make test`, `make test-all` and `make demo` set up .venv on first use, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
PKG_STAMP := $(VENV)/.installed-package
PKG_VENV := build/package-venv

.PHONY: test test-all demo bench-smoke lint docs package clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

$(PKG_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[package]"
	touch $(PKG_STAMP)

# The fast tier: every test not marked `slow` (a few minutes on 2 cores). It touches each
# guarantee of docs/guarantees.md at least once; the full tier adds the rest.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow" tests

# Every test, as CI runs it: the long matrices, the fuzzing and the soak (JAXCKPT_SOAK_S
# seconds, 30 unless set) included (about 14 minutes on 2 cores, in two workers).
test-all: $(STAMP)
	JAXCKPT_SOAK_S=$${JAXCKPT_SOAK_S:-30} $(PY) -m pytest -q -n 2 tests

demo: $(STAMP)
	$(PY) examples/flax_nnx.py

bench-smoke: $(STAMP)
	$(PY) benchmarks/run.py --smoke
	$(PY) benchmarks/read_once.py --smoke
	$(PY) benchmarks/peak_memory.py --smoke
	$(PY) benchmarks/peer_transport.py --smoke
	$(PY) benchmarks/policy_cost.py --smoke
	$(PY) benchmarks/goodput_sim.py --smoke
	$(PY) benchmarks/dedup.py --smoke

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxckpt tests examples benchmarks tools

# the site (mkdocs.yml) into build/site; strict: a broken link or docstring reference fails
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The wheel and the sdist into dist/, checked by twine, each holding LICENSE (the sdist also
# README.md and CHANGELOG.md); then installed in a fresh venv, the wheel with its dependencies
# from the index and the sdist over it, and the installed command must run. `build` runs from /:
# in the repository the build/ folder would shadow the module.
package: $(PKG_STAMP)
	rm -rf dist $(PKG_VENV)
	cd / && $(CURDIR)/$(PY) -m build -q --outdir $(CURDIR)/dist $(CURDIR)
	$(VENV)/bin/twine check --strict dist/*
	for f in LICENSE README.md CHANGELOG.md; do \
	  tar tzf dist/jaxckpt-*.tar.gz | grep -x "jaxckpt-[^/]*/$$f" >/dev/null || { echo "the sdist lacks $$f"; exit 1; }; done
	$(PY) -m zipfile -l dist/jaxckpt-*.whl | grep "dist-info/licenses/LICENSE" >/dev/null || { echo "the wheel lacks LICENSE"; exit 1; }
	$(PYTHON) -m venv $(PKG_VENV)
	$(PKG_VENV)/bin/pip install -q dist/jaxckpt-*.whl
	cd / && help="$$($(CURDIR)/$(PKG_VENV)/bin/jaxckpt --help)" && echo "$$help" | grep "^Usage: jaxckpt" >/dev/null
	$(PKG_VENV)/bin/pip install -q --force-reinstall --no-deps dist/jaxckpt-*.tar.gz
	cd / && help="$$($(CURDIR)/$(PKG_VENV)/bin/jaxckpt --help)" && echo "$$help" | grep "^Usage: jaxckpt" >/dev/null
	cd / && $(CURDIR)/$(PKG_VENV)/bin/python -c "import jaxckpt, sys; assert jaxckpt.__file__.startswith(sys.prefix), jaxckpt.__file__"
	@echo "package: dist/ built, checked, installed in a fresh venv; jaxckpt --help runs"

clean:
	rm -rf $(VENV) .pytest_cache build/site dist $(PKG_VENV)
