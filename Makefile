# epp — developer entry points. `make install` then `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python

.PHONY: install run test test-unit test-integration lint bench-cpu bench-sched bench-routing bench-kube bench-kv-index bench-soak bench-tokenize bench-overload bench-h2-attacks clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e '.[test]'
	# xds-protos ships an older copy of opentelemetry/proto/; whichever package pip installs last
	# owns those files, so reinstall opentelemetry-proto to make the OTLP exporter's files win.
	$(PYTHON) -m pip install --quiet --force-reinstall --no-deps \
	  "opentelemetry-proto==$$($(PYTHON) -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
	touch $@

run: install
	$(BIN)/epp run

test: install
	$(BIN)/pytest -q tests

test-unit: install
	$(BIN)/pytest -q tests/unit

test-integration: install
	$(BIN)/pytest -q tests/integration

lint: install
	$(BIN)/ruff check epp tests bench
	$(BIN)/ruff format --check epp tests bench
	$(BIN)/mypy

bench-tokenize: install
	$(PYTHON) bench/tokenize_cache.py

bench-cpu: install
	$(PYTHON) bench/cpu_per_request.py

bench-sched: install
	$(PYTHON) bench/sched.py

bench-routing: install
	$(PYTHON) bench/routing.py

bench-kube: install
	$(PYTHON) bench/kube.py

bench-kv-index: install
	$(PYTHON) bench/kv_index.py

# SOAK_ARGS=--short for a smoke run; SOAK_ARGS="--duration 3600" for a long one.
bench-soak: install
	$(PYTHON) bench/soak.py $(SOAK_ARGS)

# OVERLOAD_ARGS="--runs alone no-fc", "--fc-config my-flow-control.yaml", "--duration 60 --sims 3".
bench-overload: install
	$(PYTHON) bench/overload.py $(OVERLOAD_ARGS)

# H2_ATTACK_ARGS=--short for a smoke run; "--servers epp --attacks rapid-reset,slow-read",
# "--epp-root ../other-checkout" (its .venv/bin/epp), "--duration 25 --json rows.json".
bench-h2-attacks: install
	$(PYTHON) bench/h2_attacks.py $(H2_ATTACK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
