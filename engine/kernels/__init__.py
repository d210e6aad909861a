"""The engine's compiled CPU kernels (torch custom ops in one library built by `make`, see build.py).

`paged_attention_op()` is the op, or None when the library is not built or is older than its source
(the callers then use their torch-only path, and `available_reason()` says why)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_attention.cpp",)
LIBRARY = HERE / "_morphserve_kernels.so"
logger = logging.getLogger(__name__)
_state: dict[str, object] = {}


def _load() -> None:
    if "reason" in _state:
        return
    if not LIBRARY.exists():
        _state["reason"] = f"{LIBRARY.name} not built (run `make kernels` or `python -m engine.kernels.build`)"
    elif any(s.exists() and s.stat().st_mtime > LIBRARY.stat().st_mtime for s in SOURCES):
        _state["reason"] = f"{LIBRARY.name} is older than its source (rebuild: `make kernels`)"
    else:
        try:
            torch.ops.load_library(str(LIBRARY))
            _state["reason"] = None
        except OSError as e:  # built for another torch or CPU: say so, fall back
            _state["reason"] = f"{LIBRARY.name} does not load: {e}"
    if _state["reason"]:
        logger.warning("compiled kernels unavailable: %s; using the torch-only paths", _state["reason"])


def paged_attention_op():
    _load()
    return None if _state["reason"] else torch.ops.morphserve.paged_attention


def available_reason() -> str | None:
    """None when the kernels are loaded, else why not."""
    _load()
    return _state["reason"]  # type: ignore[return-value]
