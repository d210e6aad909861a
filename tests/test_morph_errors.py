"""Bad morph input fails at load time with an error that says what to change: a profile naming layers the
model lacks, a missing host-store variant, an AWQ checkpoint of another shape, a budget too small even
with every layer at INT4 (and a budget between that and full precision starts morphed)."""
from __future__ import annotations

import json
import os

import pytest

from engine.errors import BudgetError, ModelLoadError
from engine.morph.host_store import layer_file_name
from engine.morph.swap_order import SwapOrder, load_swap_order, resolve_swap_order
from engine.precision import Precision
from tests.morph_helpers import engine_for, one_thread  # noqa: F401 (one_thread is a fixture)
from tests.test_host_store import _awq_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def write_profile(path, **fields):
    data = {"model": "tiny", "num_layers": 4, "order": [0, 1, 2, 3], "scores": [], "calibration": {}}
    data.update(fields)
    path.write_text(json.dumps(data))
    return path


def test_profile_naming_missing_layers_fails_at_load(tiny_model_dir, tmp_path):
    profile = write_profile(tmp_path / "p.json", order=[0, 7, 2, 3])
    with pytest.raises(ModelLoadError, match=r"names layers \[7\] that the model does not have.*0\.\.3"):
        engine_for(tiny_model_dir, tmp_path, profile=str(profile))


@pytest.mark.parametrize("fields, message", [
    ({"num_layers": 30}, "model with 30 layers; this model has 4"),
    ({"order": [0, 1, 1, 3]}, "each of the 4 layers exactly once"),
    ({"order": [0, 1, 2]}, "each of the 4 layers exactly once"),
    ({"order": "0,1,2,3"}, "needs an 'order' list"),
])
def test_malformed_profiles_are_refused(tmp_path, fields, message):
    with pytest.raises(ModelLoadError, match=message):
        load_swap_order(write_profile(tmp_path / "p.json", **fields), 4)


def test_unreadable_profile_and_fallbacks(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_swap_order(bad, 4)
    with pytest.raises(ModelLoadError, match="cannot read"):
        resolve_swap_order(4, "tiny", profile=str(tmp_path / "absent.json"))
    assert resolve_swap_order(4, "no-such-model") == SwapOrder((0, 1, 2, 3), "front-to-back")
    prepared = write_profile(tmp_path / "prepared.json", order=[3, 2, 1, 0])
    assert resolve_swap_order(4, "no-such-model", prepared_profile=prepared).order == (3, 2, 1, 0)


def test_committed_default_profile_matches_the_default_model():
    from engine.default_model import DEFAULT_MODEL_NAME
    from engine.morph.swap_order import committed_profile_path
    path = committed_profile_path(DEFAULT_MODEL_NAME)
    if not path.is_file():
        pytest.skip(f"{path} is not committed yet")
    order = load_swap_order(path, 30, DEFAULT_MODEL_NAME)
    assert sorted(order.order) == list(range(30))


def test_missing_variant_fails_at_load_naming_layer_and_precision(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    store_dir = engine.morph_executor.swapper.store.path
    os.remove(store_dir / layer_file_name(3, Precision.INT4))
    with pytest.raises(ModelLoadError, match=r"lacks layer 3 at int4.*re-run `python -m engine.morph.prepare"):
        engine_for(tiny_model_dir, tmp_path)


def test_variant_vanishing_at_run_time_rejects_the_action_and_keeps_serving(tiny_model_dir, tmp_path):
    from engine.morph.actions import SwapLayer
    from engine.morph.packed_store import layer_file
    engine = engine_for(tiny_model_dir, tmp_path)
    swapper = engine.morph_executor.swapper
    os.remove(swapper.store.path / layer_file_name(1, Precision.INT8))
    os.remove(layer_file(swapper.packed.folder, 1, Precision.INT8))  # its mapped copy too (test_packed_store.py)
    result = engine.apply(SwapLayer(1, Precision.INT8))
    assert result.status == "rejected" and "layer 1 at int8" in result.message
    assert engine.morph_state().num_quantized == 0
    engine.check_integrity()


def test_awq_checkpoint_of_another_shape_fails_at_load(tiny_model_dir, tmp_path):
    from engine.loader import load_config
    ckpt = _awq_checkpoint(tmp_path / "awq", load_config(tiny_model_dir), group=32, hidden_override=96)
    with pytest.raises(ModelLoadError, match=r"does not fit model .* at layer 0.*found \[96, "):
        engine_for(tiny_model_dir, tmp_path / "cache", int4_checkpoint=str(ckpt))


def test_budget_below_the_all_int4_model_is_a_budget_error_with_the_minimum(tiny_model_dir, tmp_path):
    with pytest.raises(BudgetError, match=r"even with every layer at int4: .*need at least (\d+) bytes") as err:
        engine_for(tiny_model_dir, tmp_path, memory_budget=1_200_000)
    minimum = int(err.value.args[0].split("need at least ")[1].split(" ")[0])
    engine = engine_for(tiny_model_dir, tmp_path, memory_budget=minimum)  # exactly the minimum works
    assert engine.morph_state().count(Precision.INT4) == 4
    assert engine.pool.capacity == engine.memory_plan.min_blocks
    engine.check_integrity()


def test_budget_between_int4_and_full_starts_morphed(tiny_model_dir, tmp_path):
    full = engine_for(tiny_model_dir, tmp_path)
    plan = full.memory_plan
    layer_full = full.model.layer_weight_bytes(0)
    store = full.morph_executor.swapper.store
    saved = layer_full - store.layer_bytes(0, Precision.INT4)
    # Full precision misses by a little more than one layer's saving: two layers must go to int4.
    budget = plan.weights + plan.reserve + plan.min_blocks * plan.block_bytes - saved - 1
    engine = engine_for(tiny_model_dir, tmp_path, memory_budget=budget)
    assert engine.morph_state().layer_precisions == (Precision.INT4, Precision.INT4, Precision.FP32, Precision.FP32)
    engine.check_integrity()
    with pytest.raises(BudgetError, match="need at least"):
        engine_for(tiny_model_dir, tmp_path, memory_budget=budget, enable_morphing=False)
