"""Calibration sources: recorded in the host store's manifest and key; a configured source that
cannot be had stops the start with an error naming it, never a silent round-to-nearest INT4."""
from __future__ import annotations

import pytest
import torch

from engine import datasets
from engine.errors import DataUnavailableError, ModelLoadError
from engine.loader import load_config, load_weights
from engine.model import build_model
from engine.morph.calibration import SHAREGPT_CHARS, calibration_text, sharegpt_text
from engine.morph.store_builder import StoreSpec, ensure_host_store
from engine.precision import Precision
from tests.morph_helpers import engine_for


class ByteTokenizer:
    """Fits the tiny model's 256-token vocabulary: one token per byte, ids kept above the specials."""

    def encode(self, text: str) -> list[int]:
        return [3 + b % 250 for b in text.encode("utf-8")]


def test_the_source_is_recorded_in_the_manifest_and_is_part_of_the_key(tiny_model_dir, tmp_path):
    model = build_model(load_config(tiny_model_dir), load_weights(tiny_model_dir, torch.float32), torch.float32, "cpu")
    texts = {}
    for name in ("a", "b"):
        texts[name] = tmp_path / f"{name}.txt"
        texts[name].write_text("".join(f"{name} line {i} of calibration text\n" for i in range(60)))
    stores = {}
    for name, path in texts.items():
        spec = StoreSpec(model_name="tiny", hf_dir=tiny_model_dir, full=Precision.FP32, ladder=(Precision.INT4,),
                         int4_group_size=64, calibration=str(path), calibration_seqs=2, calibration_len=16, awq_grid=2)
        stores[name] = ensure_host_store(model, spec, tmp_path / "cache", ByteTokenizer())
    a, b = stores["a"].manifest, stores["b"].manifest
    assert a.int4_method == b.int4_method == "awq"
    assert a.calibration["source"] == str(texts["a"]) and a.calibration["tokens"] == 32
    assert a.calibration["text_sha256"] != b.calibration["text_sha256"]
    assert stores["a"].path != stores["b"].path


def test_a_missing_calibration_file_stops_the_engine_naming_it(tiny_model_dir, tmp_path):
    missing = tmp_path / "no-such-text.txt"
    with pytest.raises(DataUnavailableError, match="no-such-text.txt") as err:
        engine_for(tiny_model_dir, tmp_path, calibration=str(missing))
    assert isinstance(err.value, ModelLoadError) and not (tmp_path / "models" / "tiny-llama0").exists()


def test_text_calibration_needs_a_tokenizer_and_says_how_to_do_without(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="calibration='none'"):
        engine_for(tiny_model_dir, tmp_path, calibration="sharegpt")


def test_wikitext2_that_cannot_be_had_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MORPHSERVE_DATA_WIKITEXT2", raising=False)
    monkeypatch.setenv("MORPHSERVE_OFFLINE", "1")
    monkeypatch.setenv("MORPHSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(datasets, "shared_dirs", lambda: ())
    with pytest.raises(DataUnavailableError) as err:
        calibration_text("wikitext2")
    assert err.value.dataset == "wikitext2" and "MORPHSERVE_DATA_WIKITEXT2" in str(err.value)


def test_sharegpt_text_comes_from_the_installed_wheel():
    text = calibration_text("sharegpt")
    assert text.source == "sharegpt" and len(text.text) >= SHAREGPT_CHARS
    assert text.text.startswith(sharegpt_text(10))  # whole turns, in file order
