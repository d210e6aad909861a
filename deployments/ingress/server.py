"""The OpenAI handlers behind the routes: check the model and the context length, tokenize, stream
from an EngineClient (or collect the whole answer) and map engine errors to OpenAI error bodies.

Shapes are checked by the pydantic request models; what a parameter *means* (ranges, sampling
semantics) is checked once, by the engine's SamplingParams, whose InvalidRequestError -> 400.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deployments import protocol as p
from deployments.engine_client import EngineClient, GenerateChunk, GenerateRequest, ModelInfo
from deployments.ingress.errors import HTTPError, error_payload
from deployments.ingress.settings import IngressSettings
from deployments.ingress.fanout import close_all, first_chunks, merged
from deployments.ingress.sse import SSE_DONE, SSEResponse, sse_event, unless_disconnected
from deployments.metrics import RequestTimer, ServeMetrics
from engine.sampling_params import SamplingParams

Formatter = p.CompletionFormatter | p.ChatFormatter
logger = logging.getLogger("morphserve.ingress")


class IngressServer:
    """State and handlers behind the routes (one per app)."""

    def __init__(self, engine: EngineClient, settings: IngressSettings, metrics: ServeMetrics | None):
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:  # static facts: fetch once
            self._info = await self.engine.model_info()
            if self.metrics is None:
                self.metrics = ServeMetrics(self._info.served_model_name, max_model_len=self._info.max_model_len)
        return self._info

    def error_payload(self, exc: BaseException, rid: str) -> tuple[int, dict, dict[str, str]]:
        return error_payload(exc, rid, self.settings.retry_after_s)

    async def guarded(self, request: Request, work: Callable[[], Awaitable[Any]]) -> Response:
        try:
            result = await work()
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            status, body, headers = self.error_payload(exc, request.state.request_id)
            return JSONResponse(body, status_code=status, headers=headers)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def checked_model(self, name: str | None) -> ModelInfo:
        info = await self.model_info()
        if name is not None and name != info.served_model_name:  # None: the one model served
            raise HTTPError(400, f"model {name!r} is not served here; use {info.served_model_name!r}",
                            param="model", code="model_not_found")
        return info

    @staticmethod
    def max_tokens(info: ModelInfo, num_prompt: int, requested: int | None, default: int | None, prompt_param: str) -> int:
        left = info.max_model_len - num_prompt
        if num_prompt == 0:
            raise HTTPError(400, "the prompt has no tokens", param=prompt_param)
        if left < 1:
            raise HTTPError(400, f"the prompt has {num_prompt} tokens but the context length is "
                            f"{info.max_model_len}; shorten the prompt", param=prompt_param)
        if requested is None:
            return left if default is None else min(default, left)
        if requested > left:
            raise HTTPError(400, f"max_tokens ({requested}) + prompt tokens ({num_prompt}) exceed the context "
                            f"length ({info.max_model_len}); ask for at most {left}", param="max_tokens")
        return requested

    async def respond(self, request: Request, gens: list[GenerateRequest], streaming: bool, fmt: Formatter,
                      choices: list[p.Choice], prompt_tokens: list[int], timer: RequestTimer) -> Response:
        # Wait for every first chunk before answering, so that a refusal (400/503) is an HTTP status
        # and not an error event inside a 200 stream.
        streams = [self.engine.generate(g) for g in gens]
        firsts = await first_chunks(streams)
        if streaming:
            return SSEResponse(self.events(gens[0].request_id, firsts, streams, timer, fmt, choices, prompt_tokens),
                               headers={"Cache-Control": "no-cache"})
        return await unless_disconnected(request, self.collect(firsts, streams, timer, fmt, choices, prompt_tokens))

    async def collect(self, firsts: list[GenerateChunk], streams: list[AsyncIterator[GenerateChunk]],
                      timer: RequestTimer, fmt: Formatter, choices: list[p.Choice], prompt_tokens: list[int]) -> Response:
        lasts: dict[int, GenerateChunk] = dict(enumerate(firsts))
        finish = "abort"
        try:
            async for i, chunk in merged(streams, firsts):
                timer.on_tokens(len(chunk.token_ids))
                choices[i].add(chunk)
                lasts[i] = chunk
            finish = lasts[0].finish_reason or "abort"
        except Exception:
            finish = "error"
            raise
        finally:
            self.observe(timer, finish, prompt_tokens, lasts)
            await close_all(streams)
        body = fmt.body(choices, p.usage_of(prompt_tokens, lasts))
        if lasts[0].queue_time_s is not None and isinstance(body.get("usage"), dict):
            body["usage"]["queue_time_s"] = lasts[0].queue_time_s
        return JSONResponse(body)

    async def events(self, rid: str, firsts: list[GenerateChunk], streams: list[AsyncIterator[GenerateChunk]],
                     timer: RequestTimer, fmt: Formatter, choices: list[p.Choice],
                     prompt_tokens: list[int]) -> AsyncIterator[str]:
        lasts: dict[int, GenerateChunk] = dict(enumerate(firsts))
        finish = "abort"  # stays "abort" when the client goes away mid-stream
        try:
            async for i, chunk in merged(streams, firsts):
                timer.on_tokens(len(chunk.token_ids))
                lasts[i] = chunk
                events = fmt.stream(choices[i], chunk)
                if chunk.queue_time_s is not None and events:  # for load generators (ops/bench/loadgen.py)
                    events[-1] = {**events[-1], "queue_time_s": chunk.queue_time_s}
                for data in events:
                    yield sse_event(data)
            finish = lasts[0].finish_reason or "abort"
            if fmt.exclude is None:  # include_usage: one last chunk with the whole request's usage
                yield sse_event(fmt.usage_chunk(p.usage_of(prompt_tokens, lasts)))
        except Exception as exc:  # noqa: BLE001 - the 200 is already sent; report it in the stream
            finish = "error"
            yield sse_event(self.error_payload(exc, rid)[1])
        finally:
            self.observe(timer, finish, prompt_tokens, lasts)
            await close_all(streams)
        yield SSE_DONE

    def observe(self, timer: RequestTimer, finish: str, prompt_tokens: list[int],
                lasts: dict[int, GenerateChunk]) -> None:
        if self.metrics is not None:
            output = sum(c.num_output_tokens for c in lasts.values())
            self.metrics.observe_request(timer.record(finish, sum(prompt_tokens), output))

    # ---- handlers ----

    def _check_body(self, body: p.CompletionRequest | p.ChatCompletionRequest, max_tokens: int | None,
                    info: ModelInfo) -> None:
        body.check_supported()
        choices = body.n * (len(body.prompts()) if isinstance(body, p.CompletionRequest) else 1)
        if choices > self.settings.max_choices:
            raise HTTPError(400, f"n x prompts = {choices} engine requests; this server allows at most "
                            f"{self.settings.max_choices} per request", param="n")
        check_sampling(body, max_tokens, info)
        ignored = body.ignored_fields()
        if ignored:  # vLLM's behaviour: accepted, logged, not used
            logger.warning("request fields %s are not part of the API and were ignored", ignored)

    async def _prompt_ids(self, info: ModelInfo, prompt: str | list[int], echo: bool) -> tuple[list[int], str]:
        """Token ids (BOS added as the tokenizer adds it, as vLLM does on /v1/completions) and, for
        echo, the prompt text."""
        if isinstance(prompt, str):
            return await self.engine.tokenize(prompt, add_special_tokens=True), prompt
        if any(not 0 <= t < info.vocab_size for t in prompt):
            raise HTTPError(400, f"prompt token ids must be in [0, {info.vocab_size})", param="prompt")
        return list(prompt), (await self.engine.detokenize(list(prompt)) if echo else "")

    async def completions(self, request: Request, body: p.CompletionRequest) -> Response:
        timer, rid = RequestTimer(), _request_id(request, "cmpl")
        info = await self.checked_model(body.model)
        self._check_body(body, body.max_tokens, info)
        sampling = {**body.sampling_fields(), **body.logprob_fields()}
        fmt = p.CompletionFormatter(rid, info.served_model_name, body.include_usage, body.logprobs is not None)
        gens, choices, prompt_tokens = [], [], []
        for k, prompt in enumerate(body.prompts()):
            ids, text = await self._prompt_ids(info, prompt, body.echo)
            first = await self.engine.detokenize(ids[:1]) if body.echo and body.logprobs is not None else ""
            max_tokens = self.max_tokens(info, len(ids), body.max_tokens, self.settings.completion_max_tokens, "prompt")
            prompt_tokens.append(len(ids))
            for j in range(body.n):
                index = k * body.n + j
                gens.append(GenerateRequest(_child_id(rid, index, len(body.prompts()) * body.n), tuple(ids),
                                            max_tokens, **_child_seed(sampling, j)))
                choices.append(p.Choice(index, echo=text if body.echo else "", first_token=first))
        return await self.respond(request, gens, body.stream, fmt, choices, prompt_tokens, timer)

    async def chat(self, request: Request, body: p.ChatCompletionRequest) -> Response:
        timer, rid = RequestTimer(), _request_id(request, "chatcmpl")
        info = await self.checked_model(body.model)
        self._check_body(body, body.requested_max_tokens(), info)
        ids = await self.engine.tokenize_chat(body.chat_messages())
        max_tokens = self.max_tokens(info, len(ids), body.requested_max_tokens(), None, "messages")
        sampling = {**body.sampling_fields(), **body.logprob_fields()}
        gens = [GenerateRequest(_child_id(rid, j, body.n), tuple(ids), max_tokens, **_child_seed(sampling, j))
                for j in range(body.n)]
        fmt = p.ChatFormatter(rid, info.served_model_name, body.include_usage, body.logprobs)
        return await self.respond(request, gens, body.stream, fmt, [p.Choice(j) for j in range(body.n)], [len(ids)], timer)

    async def models(self) -> dict:
        info = await self.model_info()
        card = p.ModelCard(id=info.served_model_name, created=info.created, max_model_len=info.max_model_len)
        return p.ModelList(data=[card]).model_dump()

    async def model(self, model_id: str) -> dict:
        info = await self.model_info()
        if model_id != info.served_model_name:
            raise HTTPError(404, f"model {model_id!r} does not exist; this server serves {info.served_model_name!r}",
                            param="model", code="model_not_found")
        return p.ModelCard(id=info.served_model_name, created=info.created, max_model_len=info.max_model_len).model_dump()

    async def tokenize(self, body: p.TokenizeRequest) -> dict:
        info = await self.checked_model(body.model)
        if body.messages is not None:
            ids = await self.engine.tokenize_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        elif body.prompt is not None:
            ids = await self.engine.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise HTTPError(400, "send either prompt or messages", param="prompt")
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}

    async def detokenize(self, body: p.DetokenizeRequest) -> dict:
        info = await self.checked_model(body.model)
        if any(not 0 <= t < info.vocab_size for t in body.tokens):  # found by tests/test_fuzz_api.py
            raise HTTPError(400, f"tokens must be in [0, {info.vocab_size})", param="tokens")
        return {"prompt": await self.engine.detokenize(body.tokens)}

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.check_health(), self.settings.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure means "do not route traffic here"
            reason = str(exc) or f"no answer within {self.settings.health_timeout_s} s"
            return JSONResponse(p.error_body(503, f"engine unhealthy: {reason}"), status_code=503)
        return JSONResponse({"status": "ok"})


def check_sampling(body: p.ChatCompletionRequest | p.CompletionRequest, max_tokens: int | None,
                   info: ModelInfo) -> None:
    """Fail fast, before any tokenizing or queueing, with the engine's own validator and limits (the
    engine checks the same again; nothing here decides what a value means)."""
    if max_tokens is None:  # the context decides it later: check min_tokens against itself here
        max_tokens = max(1, body.min_tokens)
    params = SamplingParams.create(max_tokens=max_tokens, **body.sampling_fields(), **body.logprob_fields())
    if info.stop_limits is not None:
        params.check_stop_limits(*info.stop_limits)


def _child_id(rid: str, index: int, total: int) -> str:
    """The engine request id of choice `index` (the HTTP id itself when there is one choice)."""
    return rid if total == 1 else f"{rid}-{index}"


def _child_seed(sampling: dict[str, Any], j: int) -> dict[str, Any]:
    """Choice j of n draws with seed + j: a seeded request is reproducible and its n choices differ."""
    if sampling.get("seed") is None or j == 0:
        return sampling
    return {**sampling, "seed": sampling["seed"] + j}


def _request_id(request: Request, prefix: str) -> str:
    request.state.request_id = f"{prefix}-{request.state.request_base}"
    return request.state.request_id
