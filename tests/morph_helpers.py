"""Helpers shared by the morph tests: a small fp32 engine on a tiny model with its own cache."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture
def one_thread():
    # Tiny tensors on a shared 2-core box: two torch threads spend most of their time synchronising.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine_for(model_dir, cache_dir, **overrides) -> LLMEngine:
    # The tiny model has no tokenizer, so no text to calibrate AWQ on: its INT4 is RTN, by config.
    cfg = dict(model=str(model_dir), dtype="fp32", memory_budget="32MiB", max_model_len=64, block_size=4,
               reserve="1MiB", seed=0, cache_dir=str(cache_dir), calibration="none")
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))
