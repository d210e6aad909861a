"""Teacher-forced top-1 agreement on a tiny random model, and token-weighted perplexity."""
from __future__ import annotations

import math

import pytest
import torch

from engine.loader import load_config, load_weights
from engine.model import build_model
from engine.morph.calibration import DenseRunner
from ops.quality.teacher_forced import (ForcedSequence, agreement, pooled, predictions, token_weighted_perplexity,
                                        tokens_by_config)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = build_model(load_config(tiny_model_dir), load_weights(tiny_model_dir, torch.float32), torch.float32, "cpu")

    def hidden(tokens):
        runner = DenseRunner(model, *tokens.shape)
        return runner.run_layers(runner.embed(tokens), 0)

    return hidden, model.compute_logits


def _greedy(tiny, prompt, n):
    hidden, logits = tiny
    ids = list(prompt)
    for _ in range(n):
        with torch.inference_mode():
            ids.append(int(logits(hidden(torch.tensor([ids]))[-1:]).argmax()))
    return tuple(ids[len(prompt):])


def test_own_greedy_output_agrees_fully_and_padding_changes_nothing(tiny):
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, (plen, n) in enumerate([(3, 5), (11, 4), (7, 9), (20, 2)]):
        prompt = tuple(torch.randint(3, 256, (plen,), generator=gen).tolist())
        seqs.append(ForcedSequence(f"s{i}", prompt, _greedy(tiny, prompt, n)))
    one_by_one = predictions(*tiny, seqs, max_batch_tokens=1)  # every sequence alone
    batched = predictions(*tiny, seqs, max_batch_tokens=4096)  # all four in one padded batch
    assert one_by_one == batched
    assert all(agreement(s, batched[s.key]).rate == 1.0 for s in seqs)
    assert pooled([agreement(s, batched[s.key]) for s in seqs]).positions == 5 + 4 + 9 + 2


def test_a_flipped_token_costs_its_position(tiny):
    prompt = (5, 17, 42, 99, 3)
    served = list(_greedy(tiny, prompt, 8))
    served[2] = (served[2] + 1) % 256  # the system chose differently at position 2
    seq = ForcedSequence("flip", prompt, tuple(served))
    result = agreement(seq, predictions(*tiny, [seq])["flip"])
    assert result.positions == 8 and result.matches <= 7
    assert result.matches >= 3  # positions 0 and 1 still agree, as does the rest where the model follows
    assert predictions(*tiny, [seq])["flip"][:2] == tuple(served[:2])
    with pytest.raises(ValueError):
        agreement(seq, (1, 2))


def test_tokens_by_config_and_weighted_perplexity():
    counts = tokens_by_config([0.1, 0.5, 1.0, 1.5, 2.5, 3.0], config_times=[0.3, 1.2, 2.8], configs=["fp", "q4", "fp"])
    # 0.1 is before the first change: the first configuration; 1.0 is still "fp"; 2.5 "q4"; 3.0 "fp".
    assert counts == {"fp": 4, "q4": 2}
    ppl = token_weighted_perplexity({"fp": 30.0, "q4": 40.0, "unused": 99.0}, counts)
    assert ppl == pytest.approx(math.exp((4 * math.log(30) + 2 * math.log(40)) / 6))
    assert token_weighted_perplexity({"fp": 30.0}, {"fp": 5}) == pytest.approx(30.0)
    assert token_weighted_perplexity({}, {}) is None
    with pytest.raises(ValueError, match="q4"):
        token_weighted_perplexity({"fp": 30.0}, counts)
