"""FakeEngine: a deterministic EngineClient without a model, for the HTTP layer's unit tests.

Tokens are Unicode code points (token id = ord(char)). The chat template joins the messages'
contents with newlines. The "model" echoes the prompt token by token, then samples the end-of-
sequence token; with ignore_eos it keeps cycling through the prompt until max_tokens. Everything
but the model is the real engine's: SamplingParams validates the parameters, and the engine's own
StopChecker turns tokens into streamed text and decides stops (stop strings held back, stop ids,
eos), token by token as LLMEngine does. It records every request, every abort (a generator closed
before it finished) and admin calls.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator

from deployments.engine_client import AdminUpdate, GenerateChunk, GenerateRequest, ModelInfo
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import StopChecker

EOS_TOKEN_ID = 0
VOCAB_SIZE = 0x110000  # every Unicode code point


class CodePointTokenizer:
    """Token id i <-> chr(i): what IncrementalDetokenizer needs of a tokenizer."""

    eos_token_ids = (EOS_TOKEN_ID,)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS_TOKEN_ID))


class FakeEngine:
    def __init__(self, model_name: str = "fake-echo", max_model_len: int = 256, token_delay_s: float = 0.0,
                 queue_limit: int = 64):
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s  # sleep before each token, to simulate decoding
        self.queue_limit = queue_limit  # requests in flight at once; more -> EngineOverloadedError
        self.created = int(time.time())
        self.requests: list[GenerateRequest] = []
        self.in_flight: set[str] = set()
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.abort_event = threading.Event()  # set at every abort; lets a test in another thread wait
        self.admin_updates: list[AdminUpdate] = []
        self.morphing_enabled = True
        self.mode = "balanced"
        self.healthy = True
        self._fault: tuple[BaseException, int] | None = None

    def inject_fault(self, exc: BaseException, after_tokens: int = 0) -> None:
        """Make the next generate() raise `exc` after yielding `after_tokens` tokens (once)."""
        self._fault = (exc, after_tokens)

    # ---- EngineClient ----

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        params = SamplingParams.create(**request.sampling_kwargs())
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt has no tokens", param="prompt")
        if len(self.in_flight) >= self.queue_limit:
            raise EngineOverloadedError(f"the waiting queue is full ({self.queue_limit} requests); retry later")
        fault, self._fault = self._fault, None
        self.requests.append(request)
        self.in_flight.add(request.request_id)
        try:
            async for chunk in self._echo(request, params, fault):
                if chunk.finish_reason is not None:  # finished once the last chunk is handed out
                    self.finished.append(request.request_id)
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):  # closed: aborted unless already finished
            if request.request_id not in self.finished:
                self.aborted.append(request.request_id)
                self.abort_event.set()
            raise
        finally:
            self.in_flight.discard(request.request_id)

    async def _echo(self, request: GenerateRequest, params: SamplingParams,
                    fault: tuple[BaseException, int] | None) -> AsyncIterator[GenerateChunk]:
        prompt = request.prompt_token_ids
        checker = StopChecker(CodePointTokenizer(), params, frozenset({EOS_TOKEN_ID}), prompt)
        for count in range(1, params.max_tokens + 1):
            if fault is not None and count - 1 == fault[1]:
                raise fault[0]
            await asyncio.sleep(self.token_delay_s)  # also lets other requests and disconnects run
            # The "model": the prompt again, then end of sequence (as LLMEngine._append_token goes on).
            at_end = count == len(prompt) + 1 and not params.ignore_eos
            token = EOS_TOKEN_ID if at_end else prompt[(count - 1) % len(prompt)]
            reason = checker.push(token)
            if reason is None and count >= params.max_tokens:
                reason = "length"
            yield self._chunk(request, checker.flush(finished=reason is not None), (token,), reason, count)
            if reason is not None:
                return

    def _chunk(self, request: GenerateRequest, text: str, ids: tuple[int, ...], finish: str | None,
               count: int) -> GenerateChunk:
        return GenerateChunk(request.request_id, text, ids, finish, len(request.prompt_token_ids), count)

    async def model_info(self) -> ModelInfo:
        return ModelInfo(self.model_name, self.max_model_len, VOCAB_SIZE, (EOS_TOKEN_ID,), self.created, (4, 8))

    async def tokenizer_files(self):
        return None  # code points have no tokenizer files: HandleEngineClient calls tokenize here

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    async def detokenize(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    async def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return await self.tokenize("\n".join(m["content"] for m in messages))

    async def check_health(self) -> None:
        if not self.healthy:
            raise EngineDeadError("the fake engine was marked unhealthy")

    async def admin_status(self) -> dict[str, Any]:
        return {"model": self.model_name, "mode": self.mode, "morphing_enabled": self.morphing_enabled,
                "num_running": len(self.in_flight)}

    async def admin_set(self, update: AdminUpdate) -> dict[str, Any]:
        self.admin_updates.append(update)
        if update.mode is not None:
            self.mode = update.mode
        if update.morphing_enabled is not None:
            self.morphing_enabled = update.morphing_enabled
        return await self.admin_status()
