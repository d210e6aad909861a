"""FakeEngine: a deterministic EngineClient without a model, for tests and for demoing the ingress.

Tokens are Unicode code points (token id = ord(char)). The chat template joins the messages'
contents with newlines. The "model" echoes the prompt token by token, then stops (end of sequence);
with ignore_eos it keeps cycling through the prompt until max_tokens. Sampling parameters are
validated by the engine's own SamplingParams, so bad values fail here as they do in the real engine.
It records every request, every abort (a generator closed before it finished) and admin calls.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator

from deployments.engine_client import AdminUpdate, GenerateChunk, GenerateRequest, ModelInfo
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.sampling_params import SamplingParams

EOS_TOKEN_ID = 0
VOCAB_SIZE = 0x110000  # every Unicode code point


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
        prompt, text, sent, count = request.prompt_token_ids, "", 0, 0
        while True:
            if fault is not None and count == fault[1]:
                raise fault[0]
            token = prompt[count % len(prompt)]
            at_eos = (count == len(prompt) or token == EOS_TOKEN_ID) and not params.ignore_eos
            if at_eos or token in params.stop_token_ids:
                yield self._chunk(request, text[sent:], (), "stop", count)  # flush held-back text
                return
            await asyncio.sleep(self.token_delay_s)  # also lets other requests and disconnects run
            count += 1
            text += chr(token)
            stop_at = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
            if stop_at >= 0:
                yield self._chunk(request, text[sent:stop_at], (token,), "stop", count)
                return
            finish = "length" if count >= params.max_tokens else None
            # Hold back a tail that may still become a stop string (as a real detokenizer must).
            keep = 0 if finish else self._stop_prefix_len(text, params.stop)
            delta, sent = text[sent:len(text) - keep], max(sent, len(text) - keep)
            yield self._chunk(request, delta, (token,), finish, count)
            if finish:
                return

    @staticmethod
    def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
        """Length of the longest end of `text` that is the start of a stop string."""
        return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)

    def _chunk(self, request: GenerateRequest, text: str, ids: tuple[int, ...], finish: str | None,
               count: int) -> GenerateChunk:
        return GenerateChunk(request.request_id, text, ids, finish, len(request.prompt_token_ids), count)

    async def model_info(self) -> ModelInfo:
        return ModelInfo(self.model_name, self.max_model_len, VOCAB_SIZE, (EOS_TOKEN_ID,), self.created)

    async def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

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
