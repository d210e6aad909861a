"""ModelRunner and model plumbing on a tiny random Llama (fp32): mixed steps equal separate steps,
chunk order does not matter, layer weights swap atomically, bad inputs fail loudly."""
from __future__ import annotations

import pytest
import torch

from engine.batch import ScheduledChunk, SchedulerOutput
from engine.errors import ModelLoadError
from engine.kv_storage import KVStorage
from engine.layers.linear import DenseLinear
from engine.model import LINEAR_NAMES, Transformer, build_model, layer_weight_names
from engine.model_runner import ModelRunner
from test_model_parity import BLOCK_SIZE, load_model

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Transformer:
    return load_model(tiny_model_dir)


def make_runner(model: Transformer, max_blocks: int = 32, linears: str = "auto") -> ModelRunner:
    c = model.config
    storage = KVStorage(c.num_layers, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cpu",
                        max_blocks=max_blocks, capacity=max_blocks)
    return ModelRunner(model, storage, "cpu", linears=linears)


def step(runner: ModelRunner, *chunks: ScheduledChunk) -> torch.Tensor:
    return runner.execute(SchedulerOutput(tuple(chunks)))


def tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


# Three requests with their own (scattered) block tables; A and B are decoding, C is mid-prefill.
A = ScheduledChunk("a", tokens(6, 1), 0, (5, 9), True)
B = ScheduledChunk("b", tokens(9, 2), 0, (2, 11, 7), True)
C1 = ScheduledChunk("c", tokens(5, 3), 0, (14, 0, 3, 20), False)
A_DEC = ScheduledChunk("a", (17,), 6, A.block_table, True)
B_DEC = ScheduledChunk("b", (33,), 9, B.block_table, True)
C2 = ScheduledChunk("c", tokens(7, 4), 5, C1.block_table, True)


def warm(runner: ModelRunner) -> None:
    step(runner, A)
    step(runner, B)
    step(runner, C1)


def test_mixed_step_equals_separate_steps(model):
    separate = make_runner(model)
    warm(separate)
    expected = torch.stack([step(separate, A_DEC)[0], step(separate, B_DEC)[0], step(separate, C2)[0]])
    mixed = make_runner(model)
    warm(mixed)
    got = step(mixed, A_DEC, B_DEC, C2)
    assert got.shape == (3, model.config.vocab_size) and got.dtype == torch.float32
    assert (got - expected).abs().max() < TOL
    # The KV written by the mixed step is what the separate steps wrote: the next decode agrees.
    nxt = ScheduledChunk("c", (40,), C2.end_pos, C1.block_table, True)
    assert (step(mixed, nxt) - step(separate, nxt)).abs().max() < TOL


def test_logits_come_back_in_chunk_order_and_only_where_needed(model):
    runner = make_runner(model)
    warm(runner)
    reference = step(runner, A_DEC, B_DEC, C2)
    runner = make_runner(model)
    warm(runner)
    b_silent = ScheduledChunk("b", B_DEC.token_ids, B_DEC.start_pos, B_DEC.block_table, False)
    got = step(runner, C2, b_silent, A_DEC)  # prefill first, a decode without logits
    assert got.shape[0] == 2
    assert (got[0] - reference[2]).abs().max() < TOL
    assert (got[1] - reference[0]).abs().max() < TOL


def test_empty_step_returns_no_logits(model):
    assert step(make_runner(model)).shape == (0, model.config.vocab_size)


def test_bad_chunks_raise_clear_errors(model):
    runner = make_runner(model)
    with pytest.raises(ValueError, match="cannot hold"):
        step(runner, ScheduledChunk("x", tokens(9, 5), 0, (1, 2), True))
    with pytest.raises(ValueError, match="token ids"):
        step(runner, ScheduledChunk("x", (10**6,), 0, (1,), True))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        step(runner, ScheduledChunk("x", (5,), model.max_positions, tuple(range(32)) * 5, True))


def copy_layer_linears(layer, scale: float = 1.0) -> dict[str, DenseLinear]:
    return {n: DenseLinear(lin.weight.clone() * scale, None if lin.bias is None else lin.bias.clone())
            for n, lin in layer.get_linears().items()}


def test_set_weights_swaps_a_layer_and_back(tiny_model_dir):
    model = load_model(tiny_model_dir)
    baseline = step(make_runner(model), A)
    layer = model.layers[1]
    original, norms = layer.get_linears(), {k: v.clone() for k, v in layer.get_norm_weights().items()}
    layer.set_weights(copy_layer_linears(layer, 0.5), {k: v * 2 for k, v in norms.items()})
    changed = step(make_runner(model), A)
    assert (changed - baseline).abs().max() > 1e-2
    layer.set_weights(original, norms)
    assert torch.equal(step(make_runner(model), A), baseline)


def test_set_weights_rejects_bad_input_without_changing_the_layer(tiny_model_dir):
    model = load_model(tiny_model_dir)
    layer = model.layers[0]
    before = layer.get_linears()
    bad = copy_layer_linears(layer)
    bad["down_proj"] = DenseLinear(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="down_proj"):
        layer.set_weights(bad)
    incomplete = copy_layer_linears(layer)
    del incomplete["q_proj"]
    with pytest.raises(ValueError, match="exactly the linears"):
        layer.set_weights(incomplete)
    with pytest.raises(ValueError, match="input_layernorm"):
        layer.set_weights(copy_layer_linears(layer), {"input_layernorm": torch.ones(3),
                                                      "post_attention_layernorm": torch.ones(3)})
    assert all(layer.get_linears()[n] is before[n] for n in LINEAR_NAMES)


def test_weight_bytes_account_for_every_tensor(model):
    c = model.config
    total = sum(t.numel() * t.element_size() for t in model.hf_tensors().values())
    rope = 2 * c.max_position_embeddings * c.head_dim * 4
    layers = sum(model.layer_weight_bytes(i) for i in range(c.num_layers))
    assert model.base_weight_bytes() + layers == total + rope
    h, i = c.hidden_size, c.intermediate_size
    assert model.layer_weight_bytes(0) == 4 * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i)


def test_build_model_names_missing_and_misshaped_tensors(model):
    weights = dict(model.hf_tensors())
    name = layer_weight_names(model.config, 2)["up_proj"]
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        build_model(model.config, {k: v for k, v in weights.items() if k != name}, torch.float32, "cpu")
    weights[name] = weights[name][:, :-1]
    with pytest.raises(ModelLoadError, match="shape"):
        build_model(model.config, weights, torch.float32, "cpu")


def test_build_model_copies_weights(model):
    weights = {k: v.clone() for k, v in model.hf_tensors().items()}
    built = build_model(model.config, weights, torch.float32, "cpu")
    for name, t in built.hf_tensors().items():
        assert t.data_ptr() != weights[name].data_ptr() and torch.equal(t, weights[name])


@pytest.mark.cuda
def test_mixed_step_on_cuda_matches_cpu(tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cpu = make_runner(load_model(tiny_model_dir))
    warm(cpu)
    expected = step(cpu, A_DEC, B_DEC, C2)
    model = load_model(tiny_model_dir).to("cuda")
    c = model.config
    storage = KVStorage(c.num_layers, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cuda",
                        max_blocks=32, capacity=32)
    gpu = ModelRunner(model, storage, "cuda")
    warm(gpu)
    assert (step(gpu, A_DEC, B_DEC, C2).cpu() - expected).abs().max() < 1e-3
