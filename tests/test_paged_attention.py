"""The in-place paged attention (engine/kernels/paged_attention.cpp, CPU) against references: a gather
of each request's blocks attended in float64 (the reference lives here, in tests), and the engine's
own torch route (gather + bmm/SDPA, what CUDA runs). Random block tables, GQA and MHA, fp32 and bf16,
steps that mix decodes, first and later prefill chunks, and blocks moved by a KV shrink."""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from engine.batch import ScheduledChunk
from engine.block_pool import BlockPool
from engine.kernels import available_reason
from engine.kv_cache_manager import KVCacheManager
from engine.kv_storage import KVStorage
from engine.layers import attention
from engine.model_runner import ModelRunner

BS = 4  # block size: small, so that contexts span many blocks


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    # `make test` builds the library first: with a compiler present, a missing library is a failure.
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the kernel is not built and the engine uses the gather route")
    assert available_reason() is None, available_reason()


def causal_reference(q, keys, values, start_pos, scale):
    """q [n, Hq, D] at positions start_pos + i, keys/values [start_pos + n, Hkv, D] -> [n, Hq, D] in float64."""
    n, hq, _ = q.shape
    group = hq // keys.shape[1]
    keys, values = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    visible = torch.arange(start_pos + n)[None, :] <= (start_pos + torch.arange(n))[:, None]  # [n, end]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def gather_reference(q, k_cache, v_cache, table, start_pos, scale):
    """q [n, Hq, D] at positions start_pos + i of one request, its K/V found through its block table."""
    end = start_pos + q.shape[0]
    ids = torch.tensor(table[: -(-end // BS)], dtype=torch.long)
    keys = k_cache.index_select(0, ids).flatten(0, 1)[:end]  # [end, Hkv, D]
    values = v_cache.index_select(0, ids).flatten(0, 1)[:end]
    return causal_reference(q, keys, values, start_pos, scale)


class _Runner(ModelRunner):
    """Only `prepare`: the metadata of a step for the route chosen by `in_place` (prefill chunks as the
    runner would send them for this dtype and head dim)."""

    def __init__(self, in_place: bool, dtype: torch.dtype, head_dim: int):
        self.device, self.in_place_attention = torch.device("cpu"), in_place
        self.causal_op = attention.causal_op_supported(dtype, self.device, head_dim)
        self.model = type("M", (), {"max_positions": 1 << 20, "config": type("C", (), {"vocab_size": 10})()})()


def make_storage(num_blocks, hkv, dim, dtype, layers=3):
    s = KVStorage(layers, BS, hkv, dim, dtype, "cpu", max_blocks=num_blocks, capacity=num_blocks)
    s.kv.copy_(torch.randn(s.kv.shape, generator=torch.Generator().manual_seed(0)).to(dtype))
    return s


def run_step(chunks, storage, layer, hq, dtype, in_place, seed=1):
    """Attention output of one step, both routes sharing the fresh q/k/v. Returns out, q, and the cache."""
    g = torch.Generator().manual_seed(seed)
    t = sum(len(c.token_ids) for c in chunks)
    hkv, dim = storage.num_kv_heads, storage.head_dim
    q = torch.randn(t, hq, dim, generator=g).to(dtype)
    k, v = torch.randn(t, hkv, dim, generator=g).to(dtype), torch.randn(t, hkv, dim, generator=g).to(dtype)
    inputs = _Runner(in_place, dtype, dim).prepare(chunks, BS)
    kc, vc = storage.layer(layer)
    out = attention.paged_attention(q, k, v, kc, vc, inputs.meta, scale=dim ** -0.5)
    return out, q, inputs


def random_step(rng, pool_ids, hq):
    """Decodes, one first chunk and one later chunk, each request on random (non-contiguous) blocks."""
    chunks, free = [], list(pool_ids)
    rng.shuffle(free)
    specs = [(rng.randint(0, 40), 1) for _ in range(5)] + [(0, rng.randint(2, 9)), (rng.randint(1, 30), rng.randint(2, 12))]
    for i, (start, n) in enumerate(specs):
        table = tuple(free.pop() for _ in range(-(-(start + n) // BS)))
        chunks.append(ScheduledChunk(f"r{i}", tuple([1] * n), start, table, needs_logits=True))
    rng.shuffle(chunks)
    return chunks


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (9, 3)])
def test_in_place_equals_gather_on_random_block_tables(dtype, tol, hq, hkv):
    rng = random.Random(hq * 10 + hkv)
    storage = make_storage(160, hkv, 16, dtype)
    for trial in range(4):
        chunks = random_step(rng, range(160), hq)
        out, q, inputs = run_step(chunks, storage, trial % 3, hq, dtype, in_place=True, seed=trial)
        assert inputs.meta.paged is not None and inputs.meta.decode is None
        kc, vc = storage.layer(trial % 3)
        for idx, (s, e) in enumerate(inputs.chunk_rows):
            c = chunks[idx]
            ref = gather_reference(q[s:e], kc, vc, c.block_table, c.start_pos, 16 ** -0.5)
            torch.testing.assert_close(out[s:e].double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_matches_the_torch_route(dtype):
    """The route CUDA runs (gather + bmm / SDPA) and the in-place one agree (the torch route rounds
    scores and probabilities to the model dtype, the kernel keeps fp32: bf16 differs by that)."""
    rng, hq = random.Random(7), 6
    storage = make_storage(120, 2, 32, dtype)
    chunks = random_step(rng, range(120), hq)
    torch_out = run_step(chunks, storage, 1, hq, dtype, in_place=False)[0]
    storage2 = make_storage(120, 2, 32, dtype)
    kernel_out = run_step(chunks, storage2, 1, hq, dtype, in_place=True)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel_out.float(), torch_out.float(), atol=tol, rtol=tol)


def test_blocks_moved_by_a_shrink_attend_the_same():
    """Requests hold blocks near the top; a shrink moves them below the new top (copy_blocks + remap),
    and the same decode step gives the same output from the moved blocks."""
    hq, hkv, dim, dtype = 6, 2, 16, torch.bfloat16
    pool = BlockPool(capacity=64, max_blocks=64)
    manager = KVCacheManager(pool, BS)
    storage = make_storage(64, hkv, dim, dtype)
    filler = pool.allocate(40)  # occupies the low ids, so the requests land high
    contexts = {"a": 23, "b": 9, "c": 17}
    for rid, n in contexts.items():
        assert manager.allocate_slots(rid, n + 1)
    pool.free(filler)
    before = [ScheduledChunk(r, (1,), n, manager.block_table(r), needs_logits=True) for r, n in contexts.items()]
    out_before = run_step(before, storage, 2, hq, dtype, in_place=True)[0]
    mapping = pool.plan_shrink(24)
    assert mapping and all(old >= 24 for old in mapping)  # the requests' blocks really move
    storage.copy_blocks(mapping)
    manager.remap(mapping)
    pool.apply_shrink(mapping, 24)
    storage.set_capacity(24)
    after = [ScheduledChunk(r, (1,), n, manager.block_table(r), needs_logits=True) for r, n in contexts.items()]
    assert all(max(c.block_table) < 24 for c in after)
    out_after = run_step(after, storage, 2, hq, dtype, in_place=True)[0]
    assert torch.equal(out_before, out_after)


def test_bad_block_id_is_rejected_not_read():
    storage = make_storage(8, 2, 16, torch.float32)
    chunk = ScheduledChunk("r", (1,), 5, (99, 0), needs_logits=True)  # writes to block 0, reads 99
    with pytest.raises(RuntimeError, match="block id 99 out of range"):
        run_step([chunk], storage, 0, 4, torch.float32, in_place=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernel_multi_row_runs_are_causal(dtype, tol):
    """The op's runs of several rows (prefill chunks: the runner sends decodes only, since SDPA wins
    there) mask causally inside the run, tiles of 8 rows included."""
    from engine.kernels import paged_attention_op
    storage, rng = make_storage(40, 2, 16, dtype), random.Random(3)
    kc, vc = storage.layer(0)
    runs = [(0, 19, 5), (19, 1, 30), (20, 9, 0)]  # (row_start, num_rows, start_pos)
    q = torch.randn(29, 6, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    ids = list(range(40))
    rng.shuffle(ids)
    tables = [ids[0:7] + [0], ids[7:15], ids[15:18] + [0] * 5]  # padded to 8 blocks
    out = paged_attention_op()(q, kc, vc, torch.tensor(tables), *(torch.tensor(c) for c in zip(*runs)), 0.25)
    for (row, n, start), table in zip(runs, tables):
        ref = gather_reference(q[row:row + n], kc, vc, table, start, 0.25)
        torch.testing.assert_close(out[row:row + n].double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4)])
def test_head_dims_of_real_models_match_the_reference(dim, hq, hkv):
    """Head dims 32/64/128 in bf16: on a CPU with AVX512-BF16 the kernel's vdpbf16ps route (16-key
    reductions, key-pair p.v); decodes and multi-row runs, odd context lengths, random tables."""
    from engine.kernels import paged_attention_op
    storage, rng = make_storage(96, hkv, dim, torch.bfloat16, layers=1), random.Random(dim + hq)
    kc, vc = storage.layer(0)
    runs = [(0, 1, 0), (1, 1, 16), (2, 1, 37), (3, 11, 0), (14, 1, 70), (15, 5, 42)]  # (row, n, start)
    ids = list(range(96))
    rng.shuffle(ids)
    need = [-(-(s + n) // BS) for _, n, s in runs]
    width = max(need)
    tables, used = [], 0
    for k in need:
        tables.append(ids[used:used + k] + [0] * (width - k))
        used += k
    q = torch.randn(20, hq, dim, generator=torch.Generator().manual_seed(dim)).to(torch.bfloat16)
    out = paged_attention_op()(q, kc, vc, torch.tensor(tables), *(torch.tensor(c) for c in zip(*runs)), dim ** -0.5)
    for (row, n, start), table in zip(runs, tables):
        ref = gather_reference(q[row:row + n], kc, vc, table, start, dim ** -0.5)
        torch.testing.assert_close(out[row:row + n].double(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("decodes", [3, 24])
def test_long_decodes_match_the_reference_at_any_thread_count(decodes):
    """Decodes with contexts of many blocks, in bf16 at head dim 64: few enough to be split per kv head (3),
    or one item per request (24). Each thread prefetches along its items' blocks and into its next item's;
    the output must match the reference and be bit-identical whichever thread runs which item."""
    from engine.kernels import paged_attention_op
    hq, hkv, dim = 9, 3, 64
    storage, rng = make_storage(1200, hkv, dim, torch.bfloat16, layers=1), random.Random(decodes)
    kc, vc = storage.layer(0)
    starts = [rng.randint(0, 190) for _ in range(decodes)]
    ids = list(range(1200))
    rng.shuffle(ids)
    width = max(-(-(s + 1) // BS) for s in starts)
    tables = [ids[i * width:(i + 1) * width] for i in range(decodes)]
    q = torch.randn(decodes, hq, dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    args = (torch.tensor(tables), torch.arange(decodes), torch.ones(decodes, dtype=torch.long), torch.tensor(starts))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(paged_attention_op()(q, kc, vc, *args, dim ** -0.5))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for i, (start, table) in enumerate(zip(starts, tables)):
        ref = gather_reference(q[i:i + 1], kc, vc, table, start, dim ** -0.5)
        torch.testing.assert_close(outs[0][i:i + 1].double(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("n,start,hq,hkv,dim", [(1, 0, 9, 3, 64), (70, 0, 9, 3, 64), (129, 0, 4, 4, 128),
                                                 (50, 37, 9, 3, 64), (64, 192, 6, 2, 32)])
def test_causal_op_attention_is_causal_with_offset(n, start, hq, hkv, dim):
    """The prefill op (causal_attention.cpp, AVX512-BF16 with or without AMX): rows at positions start + i see keys <= their own, across
    64-key blocks and partial ones, GQA and MHA; against the float64 reference and the SDPA route."""
    from engine.kernels import causal_attention_op, causal_attention_reason
    if causal_attention_reason() is not None:
        pytest.skip(causal_attention_reason())
    g = torch.Generator().manual_seed(n + start)
    qkv = torch.randn(n, hq + 2 * hkv, dim, generator=g).to(torch.bfloat16)  # strided views, as the model's
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    if start:
        k = torch.cat([torch.randn(start, hkv, dim, generator=g).to(torch.bfloat16), k])
        v = torch.cat([torch.randn(start, hkv, dim, generator=g).to(torch.bfloat16), v])
    out = causal_attention_op()(q, k, v, start, dim ** -0.5)
    torch.testing.assert_close(out.double(), causal_reference(q, k, v, start, dim ** -0.5), atol=1e-2, rtol=1e-2)
    visible = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=visible, scale=dim ** -0.5, enable_gqa=True).squeeze(0).transpose(0, 1)
    torch.testing.assert_close(out.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


def test_causal_op_output_does_not_depend_on_the_thread_count():
    """Threads take the op's items (kv head, 64-token query block) longest first from a shared counter, so
    which thread computes which item varies from call to call; each item's output must not."""
    from engine.kernels import causal_attention_op, causal_attention_reason
    if causal_attention_reason() is not None:
        pytest.skip(causal_attention_reason())
    g = torch.Generator().manual_seed(7)
    n, start, hq, hkv, dim = 300, 45, 9, 3, 64
    q = torch.randn(n, hq, dim, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(start + n, hkv, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3, 2):
            torch.set_num_threads(t)
            outs.append(causal_attention_op()(q, k, v, start, dim ** -0.5))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.testing.assert_close(outs[0].double(), causal_reference(q, k, v, start, dim ** -0.5), atol=1e-2, rtol=1e-2)


def test_causal_op_attention_rejects_bad_shapes():
    from engine.kernels import causal_attention_op, causal_attention_reason
    if causal_attention_reason() is not None:
        pytest.skip(causal_attention_reason())
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(5, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"positions \[0, start \+ n\)"):
        causal_attention_op()(q, kv, kv, 0, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        causal_attention_op()(q.float(), kv.float(), kv.float(), 1, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_op_fills_the_same_slots_as_index_put(dtype):
    storage = KVStorage(3, BS, 2, 8, dtype, "cpu", max_blocks=12, capacity=12)
    kc, vc = storage.layer(1)
    qkv = torch.randn(10, 9, 8).to(dtype)  # k and v as strided views of a fused projection, as the layer has them
    k, v = qkv[:, 5:7], qkv[:, 7:]
    blocks = torch.tensor([3, 3, 0, 11, 7, 7, 7, 7, 2, 5])
    offsets = torch.tensor([0, 1, 3, 2, 0, 1, 2, 3, 1, 0])
    want_k, want_v = kc.clone(), vc.clone()
    want_k.index_put_((blocks, offsets), k)
    want_v.index_put_((blocks, offsets), v)
    torch.ops.morphserve.write_kv(kc, vc, k, v, blocks, offsets)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    other_k, other_v = storage.layer(2)
    assert not other_k.any() and not other_v.any()  # only layer 1's slots were written


def test_kv_write_op_rejects_slots_outside_the_cache():
    storage = KVStorage(1, BS, 2, 8, torch.float32, "cpu", max_blocks=4, capacity=4)
    kc, vc = storage.layer(0)
    k = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.morphserve.write_kv(kc, vc, k, k, torch.tensor([0, 4]), torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.morphserve.write_kv(kc, vc, k.to(torch.bfloat16), k, torch.tensor([0, 1]), torch.tensor([0, 0]))
