# The two commands a fresh machine needs:  `make demo`  and  `make test`.
VENV ?= .venv
PYTHON ?= python3
INSTALLED := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --progress-bar off -e '.[test]'
	touch $@

setup: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/onceflow demo

test: $(INSTALLED)
	bash deploy/run-tests.sh $(PYTEST_ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check service connectors tests examples bench
	$(VENV)/bin/ruff format --check service connectors tests examples bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
