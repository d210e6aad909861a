"""Sampler: greedy, top-k/top-p filtering, seeded reproducibility alone and in a batch."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import argmax_op
from engine.sampler import greedy, sample
from engine.sampling_params import SamplingParams


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def logits_rows(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=gen(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_rows(4)
    got = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert got == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_rows(3)
    expected = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(top_k=1, seed=1)] * 3, [gen(i) for i in range(3)]) == expected
    assert sample(logits, [SamplingParams(top_p=1e-6, seed=1)] * 3, [gen(i) for i in range(3)]) == expected


def test_top_k_keeps_only_the_k_best():
    row = torch.arange(20, dtype=torch.float32).unsqueeze(0)  # token 19 best, then 18, 17
    g = gen(3)
    seen = {sample(row, [SamplingParams(temperature=5.0, top_k=3)], [g])[0] for _ in range(200)}
    assert seen == {17, 18, 19}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    g = gen(4)
    seen = {sample(probs.log(), [SamplingParams(top_p=0.7)], [g])[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    g = gen(5)
    draws = [sample(probs.log(), [SamplingParams()], [g])[0] for _ in range(2000)]
    freq = [draws.count(t) / len(draws) for t in range(3)]
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05 and abs(freq[2] - 0.1) < 0.04


def test_same_seed_same_tokens_alone_or_batched():
    logits = logits_rows(6, seed=9)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=100 + i)
              for i, (t, k, p) in enumerate([(1.0, -1, 1.0), (0.7, 5, 1.0), (0, -1, 1.0),
                                             (1.3, -1, 0.9), (0.9, 10, 0.8), (2.0, -1, 1.0)])]
    alone = [[sample(logits[i:i + 1], [params[i]], [g])[0] for _ in range(5)]
             for i, g in ((i, gen(100 + i)) for i in range(6))]
    gens = [gen(100 + i) for i in range(6)]
    batched = [sample(logits, params, gens) for _ in range(5)]
    assert [[b[i] for b in batched] for i in range(6)] == alone
    assert len({tuple(a) for a in alone[:2]}) == 2  # not a constant


@pytest.mark.skipif(argmax_op() is None, reason="the compiled kernels are not built")
def test_compiled_greedy_argmax_is_torch_argmax_with_its_ties_and_nans():
    torch.manual_seed(0)
    vocab = 49_157  # not a multiple of the vector width: the tail is scanned too
    logits = torch.randn(9, vocab)
    logits[1, 100] = logits[1, 40_000] = 1e4  # a tie: the first index
    logits[2, vocab - 1] = 1e4  # the max in the tail
    logits[3] = float("-inf")  # all -inf: index 0
    logits[4, 7] = logits[4, 5000] = float("nan")  # NaN wins, the first one
    logits[5, :] = 1.0  # all equal
    logits[6, 3] = float("inf")
    for rows in (logits, logits[:1], logits[::2]):  # non-contiguous rows too
        assert torch.equal(greedy(rows), rows.argmax(dim=-1))
    assert torch.equal(argmax_op()(logits), logits.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="fp32"):
        argmax_op()(logits.to(torch.bfloat16))
