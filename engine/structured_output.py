"""Structured output (response_format json_object / json_schema) through xgrammar, the grammar
engine vLLM uses.

`GrammarCompiler` is built once per engine, on the first request that needs it (building xgrammar's
view of the vocabulary takes seconds), and caches compiled grammars. Each request gets a
`GrammarState`: before every sampled token it yields the allowed tokens as a bool mask (the sampler
sets the rest to -inf), after it the token is accepted and the matcher advances. When the grammar
is complete only the stop tokens are allowed, so the request ends with a finished JSON text; a
request that runs out of max_tokens first ends with finish_reason "length" and truncated JSON.
"""
from __future__ import annotations

import json
import logging
import threading

import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)
_BITS = 32  # xgrammar packs the allowed-token mask 32 tokens per int32


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], max_threads: int = 1):
        import xgrammar  # imported here: engines that never see response_format do not load it
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads)
        self._lock = threading.Lock()  # add_request may come from several threads

    def compile(self, spec: StructuredOutput) -> "GrammarState":
        with self._lock:
            if spec.kind == "json_object":
                compiled = self._compiler.compile_builtin_json_grammar()
            else:
                compiled = self._compile_schema(spec.json_schema)
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.vocab_size, self._xgr)

    def _compile_schema(self, schema: str):
        try:
            json.loads(schema)
            return self._compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # noqa: BLE001 - json and xgrammar raise several types for a bad schema
            raise InvalidRequestError(f"response_format.json_schema.schema cannot be compiled: {e}",
                                      param="response_format") from e


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int, xgr):
        self._matcher, self._vocab_size, self._xgr = matcher, vocab_size, xgr
        self._shifts = torch.arange(_BITS, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens that keep the output inside the grammar (reads, does not advance)."""
        bitmask = self._xgr.allocate_token_bitmask(1, self._vocab_size)  # [1, ceil(vocab / 32)] int32
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> self._shifts) & 1  # [words, 32], bit j of word w = token 32w + j
        return bits.flatten()[:self._vocab_size].bool()

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} is outside the request's grammar (the mask allowed it)")

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()
