"""Shared fixtures: a tiny random Llama-family model on disk, the real default model, and `threshold` (sets a
test module's quantized rung dispatch threshold and restores it after the test)."""
from __future__ import annotations

import os
from pathlib import Path

# Several processes (pytest, Ray workers, engine threads) share 2 cores in these tests: OpenMP threads
# that spin while waiting for each other turn a 70 ms decode step into seconds. Must precede `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests share 2 cores with whatever else runs; keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def make_tiny_hf_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random Llama / Mistral / Qwen2 model in Hugging Face format (config.json + safetensors),
    plus a copy of the default model's tokenizer files when those are available."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    config = cls[0](**common)
    model = cls[1](config).to(torch.float32)
    # Random init has tiny weights; scale up so logits are not all near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted once, then cached)."""
    from engine.config import default_cache_dir
    from engine.loader import resolve_model

    return resolve_model("default", default_cache_dir()).hf_dir


# Ending the test process: once pytest has reported and cleaned up, the interpreter's own teardown still
# runs beside threads that native libraries started (Ray's core worker, engine threads of in-process
# engines) and once segfaulted there, in libstdc++, after "834 passed": make test failed with every test
# green. So the process ends right after pytest, with pytest's exit status (5, no tests, included):
# Ray is shut down first, as its own exit handler would, then os._exit skips the teardown.
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


def pytest_unconfigure(config):
    import atexit

    status = config.stash.get(_EXIT_STATUS, None)
    if status is not None:
        atexit.register(_end_process, status)  # registered last, so it runs first of the exit handlers


def _end_process(status: int) -> None:
    import sys

    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - a failed shutdown must not change the tests' verdict
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture
def threshold(request):
    """Sets the process-wide row threshold of the test module's quantized rung (its `RUNG`: "int4" or "int8";
    quant/dispatch.py) and puts the previous record back after the test."""
    from engine.quant.dispatch import amx_dispatch, set_amx_dispatch, update_amx_dispatch

    field = f"{request.module.RUNG}_min_rows"
    before = amx_dispatch()
    yield lambda rows: update_amx_dispatch(**{field: rows})
    set_amx_dispatch(before)

