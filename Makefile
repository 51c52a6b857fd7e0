# The two commands a fresh machine needs:  `make demo`  and  `make test`.
VENV ?= .venv
PYTHON ?= python3
INSTALLED := $(VENV)/.installed

.PHONY: setup demo test lint bench bench-joins bench-recovery clean constraints

$(INSTALLED): pyproject.toml deploy/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --progress-bar off -c deploy/constraints.txt -e '.[test]'
	$(VENV)/bin/python -m onceflow.pyspark_bytecode
	$(VENV)/bin/python -m onceflow.class_archive
	touch $@

setup: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/onceflow demo

test: $(INSTALLED)
	bash deploy/run-tests.sh $(PYTEST_ARGS)

# The Nexmark benchmark: onceflow next to Quix Streams, Spark's JVM Kafka connector and the
# copier ceiling; results in bench/results/.
bench: $(INSTALLED)
	$(VENV)/bin/python -m pip install --quiet -e '.[bench]'
	$(VENV)/bin/onceflow kafka start
	$(VENV)/bin/python -m bench.run $(BENCH_ARGS)

# Nexmark Q8's stream-stream join: onceflow's SQL next to Spark's JVM connector and Quix
# Streams, each output checked against the join computed from the records.
bench-joins: $(INSTALLED)
	$(VENV)/bin/onceflow kafka start
	$(VENV)/bin/python -m bench.joins $(BENCH_ARGS)

# Restart to first output, progress under a SIGKILL loop, an epoch's fixed cost.
bench-recovery: $(INSTALLED)
	$(VENV)/bin/onceflow kafka start
	$(VENV)/bin/python -m bench.recovery $(BENCH_ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check service connectors tests examples bench
	$(VENV)/bin/ruff format --check service connectors tests examples bench

# Pin the newest runtime dependencies pyproject.toml allows (then run `make test` on them).
constraints:
	rm -rf build/pins && $(PYTHON) -m venv build/pins
	build/pins/bin/python -m pip install --quiet --progress-bar off .
	{ grep '^#' deploy/constraints.txt; build/pins/bin/python -m pip freeze --exclude onceflow; } \
		> build/constraints.txt
	mv build/constraints.txt deploy/constraints.txt && rm -rf build

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
