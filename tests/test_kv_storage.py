"""KVStorage: block-major layout, copies and moves across all layers, real page release on shrink (CPU);
the ledger's refusals."""
from __future__ import annotations

import os

import pytest
import torch

from engine.kv_storage import KVStorage
from engine.ledger import MemoryLedger

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def make(max_blocks=8, capacity=4, layers=3, head_dim=8) -> KVStorage:
    return KVStorage(num_layers=layers, block_size=4, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32,
                     device="cpu", max_blocks=max_blocks, capacity=capacity)


def test_layout_and_block_bytes():
    s = make()
    assert s.kv.shape == (8, 3, 2, 4, 2, 8)
    assert s.block_bytes == 3 * 2 * 4 * 2 * 8 * 4
    k, v = s.layer(1)
    assert k.shape == v.shape == (8, 4, 2, 8)
    k[2].fill_(5.0)
    assert torch.all(s.kv[2, 1, 0] == 5.0) and torch.all(s.kv[2, 1, 1] == 0)


def test_copy_blocks_moves_every_layer():
    s = make()
    for layer in range(3):
        k, v = s.layer(layer)
        k[3].fill_(layer + 1.0)
        v[3].fill_(-(layer + 1.0))
    s.copy_blocks({3: 0})
    for layer in range(3):
        k, v = s.layer(layer)
        assert torch.all(k[0] == layer + 1.0) and torch.all(v[0] == -(layer + 1.0))
    with pytest.raises(ValueError):
        s.copy_blocks({1: 2, 2: 3})


def test_shrink_returns_pages_to_the_os():
    # 64 blocks of 1 MiB: RSS must rise by ~48 MiB when 48 committed blocks are written, and fall
    # by ~32 MiB when capacity drops to 16 (the kept 16 blocks stay resident and intact).
    s = KVStorage(num_layers=4, block_size=16, num_kv_heads=4, head_dim=512, dtype=torch.float32,
                  device="cpu", max_blocks=64, capacity=48)
    assert s.block_bytes == 2**20
    before = rss_bytes()
    s.kv[:48].fill_(1.0)
    written = rss_bytes()
    assert written - before > 40 * 2**20
    s.set_capacity(16)
    after = rss_bytes()
    assert written - after > 24 * 2**20
    assert torch.all(s.kv[:16] == 1.0)
    s.set_capacity(48)  # regrown blocks come back zeroed (fresh pages), the kept ones unchanged
    assert torch.all(s.kv[16:48] == 0) and torch.all(s.kv[:16] == 1.0)


def test_ledger_refuses_changes_over_budget():
    ledger = MemoryLedger(budget=1000, reserve=100)
    ledger.set_base_weights(300)
    ledger.set_layer_weights(0, 200)
    ledger.set_kv(400)
    assert ledger.figures().free == 0 and ledger.free == 0
    with pytest.raises(RuntimeError, match="over budget"):
        ledger.set_kv(401)
    assert ledger.kv == 400  # the refused change left nothing behind
    ledger.set_layer_weights(0, 50)
    assert ledger.free == 150
    ledger.check_integrity()


def test_copy_blocks_in_runs_equals_indexed_copy():
    """Runs of consecutive ids are copied as one memcpy; the result equals an indexed gather/scatter,
    for random scattered and partly consecutive mappings."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        s = make(max_blocks=64, capacity=64)
        s.kv.copy_(torch.randn(s.kv.shape, generator=gen))
        ids = torch.randperm(64, generator=gen).tolist()
        n = 1 + trial
        src = sorted(ids[:n]) if trial % 2 else ids[:n]
        dst = sorted(ids[n:2 * n]) if trial % 3 else ids[n:2 * n]
        if trial % 4 == 0:  # consecutive runs on both sides
            src, dst = list(range(40, 40 + n)), list(range(0, n))
        expected = s.kv.clone()
        expected[torch.tensor(dst)] = s.kv[torch.tensor(src)]
        s.copy_blocks(dict(zip(src, dst)))
        assert torch.equal(s.kv, expected), trial


def test_move_blocks_equals_a_copy_and_moves_pages_when_blocks_are_whole_pages():
    """Page-sized blocks move by remapping (the sources read as zeros afterwards: nothing was copied);
    other sizes are copied. Either way every destination holds its source's contents."""
    gen = torch.Generator().manual_seed(1)
    for head_dim, moves_pages in ((64, True), (6, False)):  # block bytes 3 x 2 x 4 x 2 x 64 x 4 = 12 KiB; 1152
        s = make(max_blocks=64, capacity=64, head_dim=head_dim)
        assert (s.block_bytes % 4096 == 0) == moves_pages
        s.kv.copy_(torch.randn(s.kv.shape, generator=gen))
        src, dst = [40, 41, 42, 50, 60, 61], [0, 1, 2, 9, 3, 4]
        expected = s.kv[src].clone()
        s.move_blocks(dict(zip(src, dst)))
        assert torch.equal(s.kv[dst], expected)
        if moves_pages:
            assert torch.all(s.kv[src] == 0)
        with pytest.raises(ValueError):
            s.move_blocks({1: 2, 2: 3})
    s = make(max_blocks=64, capacity=64, head_dim=64)
    s.kv.copy_(torch.randn(s.kv.shape, generator=gen))
    s._splits_left = 3  # the map-count allowance is spent: runs are copied (the sources keep their contents)
    expected = s.kv[[40, 41]].clone()
    s.move_blocks({40: 0, 41: 1})
    assert torch.equal(s.kv[[0, 1]], expected) and torch.equal(s.kv[[40, 41]], expected)


def test_ledger_stages_a_copy_within_the_budget_only():
    ledger = MemoryLedger(budget=1000, reserve=100)
    ledger.set_layer_weights(0, 500)
    ledger.stage(("a", 1), 300)
    assert ledger.staged == 300 and ledger.weights == 800 and ledger.free == 100
    with pytest.raises(RuntimeError, match="over budget"):
        ledger.stage(("b", 1), 101)
    assert ledger.staged == 300  # the refused stage left nothing behind
    ledger.unstage(("a", 1))
    assert ledger.staged == 0 and ledger.free == 400
