"""The small protocol between the HTTP ingress and an engine, and the records that cross it.

The ingress only ever sees an `EngineClient`: in tests a `FakeEngine`, in Ray Serve a
`HandleEngineClient` over the engine replica's DeploymentHandle. Records are frozen dataclasses of
plain values, so they pickle across the Ray boundary. Exceptions do not cross it well (Ray wraps them
and drops custom attributes such as `param`), so the replica turns engine errors into a final chunk
with `error` set (`stream_with_error_chunks`) and `HandleEngineClient` raises them again on this side.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator, Callable, Literal, Protocol, runtime_checkable

from controller.policy_config import ModeName
from deployments.overload_gate import OverloadGate
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.logprobs import PositionLogprobs
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import StructuredOutput
from engine.tokenizer import Tokenizer

logger = logging.getLogger("morphserve.ingress")
# Times a request whose engine replica died before answering is sent again (HandleEngineClient.generate):
# enough for Serve's router to drop a dead replica it still listed (it learns of the death from the
# failed call or the controller's next broadcast).
REPLICA_LOST_RETRIES = 3

ErrorKind = Literal["invalid_request", "overloaded", "dead", "internal"]


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One generation: the prompt is already tokenized (the ingress applied the chat template)."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # top logprobs per sampled token (None: none at all)
    prompt_logprobs: int | None = None  # the same per prompt token (echo with logprobs)
    structured_output: StructuredOutput | None = None
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.sampling_params.SamplingParams.create."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("request_id", "prompt_token_ids")}


@dataclasses.dataclass(frozen=True)
class EngineErrorInfo:
    """Why the engine refused or failed a request, as plain values (see module docstring)."""
    kind: ErrorKind
    message: str
    param: str | None = None


@dataclasses.dataclass(frozen=True)
class GenerateChunk:
    """A delta of one request's output. The last chunk has finish_reason set (or error)."""
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    error: EngineErrorInfo | None = None
    queue_time_s: float | None = None
    logprobs: tuple[PositionLogprobs, ...] | None = None  # one per token id, when asked for
    prompt_logprobs: tuple[PositionLogprobs | None, ...] | None = None  # on the first chunk, when asked for
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache (not prefilled)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Static facts about the served model, fetched once by the ingress."""
    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    created: int  # unix seconds when the engine loaded the model
    stop_limits: tuple[int, int] | None = None  # (most stop strings, longest in characters); None: no limit


@dataclasses.dataclass(frozen=True)
class AdminUpdate:
    """An operator's change to morphing; None fields stay as they are."""
    mode: ModeName | None = None  # pin the policy mode
    morphing_enabled: bool | None = None  # False: stop morphing (and restore as pressure allows)
    quantized_layers: int | None = None  # pin this many layers below full precision...
    precision: Literal["int8", "int4"] | None = None  # ...at this precision


@runtime_checkable
class EngineClient(Protocol):
    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """An async generator of chunks. Closing it early (client gone) aborts the request.
        Raises InvalidRequestError, EngineOverloadedError, EngineDeadError or anything else."""
        ...

    async def model_info(self) -> ModelInfo: ...

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: what the tokenizer adds around a text (BOS for Llama-style models), as
        vLLM does for /v1/completions and /tokenize."""
        ...

    async def detokenize(self, token_ids: list[int]) -> str: ...

    async def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Apply the model's chat template (with the generation prompt) and tokenize."""
        ...

    async def check_health(self) -> None:
        """Return when the engine can serve; raise (e.g. EngineDeadError) when it cannot."""
        ...

    async def admin_status(self) -> dict[str, Any]: ...

    async def admin_set(self, update: AdminUpdate) -> dict[str, Any]: ...


def error_info_from_exception(exc: BaseException) -> EngineErrorInfo:
    if isinstance(exc, InvalidRequestError):
        return EngineErrorInfo("invalid_request", str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return EngineErrorInfo("overloaded", str(exc))
    if isinstance(exc, EngineDeadError):
        return EngineErrorInfo("dead", str(exc))
    return EngineErrorInfo("internal", f"{type(exc).__name__}: {exc}")


class EngineInternalError(RuntimeError):
    """An unexpected fault inside the engine replica, re-raised on the ingress side (-> HTTP 500)."""


def exception_from_error_info(info: EngineErrorInfo) -> Exception:
    if info.kind == "invalid_request":
        return InvalidRequestError(info.message, param=info.param)
    if info.kind == "overloaded":
        return EngineOverloadedError(info.message)
    if info.kind == "dead":
        return EngineDeadError(info.message)
    return EngineInternalError(info.message)


async def stream_with_error_chunks(request: GenerateRequest,
                                   stream: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
    """Replica side: pass chunks through, and turn an exception into one final error chunk."""
    sent = None
    try:
        async for chunk in stream:
            sent = chunk
            yield chunk
    except Exception as exc:  # noqa: BLE001 - every failure must reach the client as a chunk
        yield GenerateChunk(request.request_id, "", (), None,
                            sent.num_prompt_tokens if sent else len(request.prompt_token_ids),
                            sent.num_output_tokens if sent else 0, error_info_from_exception(exc))
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


# Below this many characters tokenizing takes well under a millisecond, less than a worker-thread hop
# (which, under a burst on 2 cores, waits for the GIL twice); longer texts go to a worker thread, so
# the ingress keeps streaming meanwhile.
INLINE_TOKENIZE_CHARS = 2048


async def _off_loop_if_long(fn: Callable[[], Any], size: int) -> Any:
    return fn() if size <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(fn)


class HandleEngineClient:
    """EngineClient over a Ray Serve DeploymentHandle to the engine replica deployment, whose
    methods have the same names: `generate` streams chunks (errors as chunks), the others return
    values. Ray Serve's back-pressure becomes EngineOverloadedError (-> 503).

    Tokenizing happens here, in the ingress (as vLLM's API server does): the engine's tokenizer is
    fetched once (`tokenizer_files`) and rebuilt, so a request costs the busy engine replica one call,
    not two. An OverloadGate refuses generation here while the engines are known full."""

    def __init__(self, handle: Any, refusal_hold_s: float = 0.0):
        self._handle = handle
        self.gate = OverloadGate(refusal_hold_s)
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_fetched = False  # False: not asked yet; True and None: the model has none
        self._tokenizer_lock = asyncio.Lock()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The replica's chunks. A request whose replica dies before it sent anything (killed, crashed,
        or the router picked it before learning of its death) goes again, to the replicas Serve still
        has, up to REPLICA_LOST_RETRIES times: nothing of it reached the client, and no replica holds
        its state. One that had started streaming fails (500): its tokens so far cannot be resumed."""
        from ray.exceptions import RayActorError

        self.gate.check()
        for attempt in range(REPLICA_LOST_RETRIES + 1):
            sent = False
            try:
                async for chunk in self._generate_once(request):
                    sent = True
                    yield chunk
                return
            except RayActorError as exc:
                if sent or attempt == REPLICA_LOST_RETRIES:
                    raise
                logger.warning("request %s: its engine replica died before answering (%s); sending it again "
                               "(%d of %d)", request.request_id, type(exc).__name__, attempt + 1, REPLICA_LOST_RETRIES)

    async def _generate_once(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        from ray.serve.exceptions import BackPressureError

        responses = self._handle.options(stream=True).generate.remote(request)
        finished = refused = False
        try:
            async for chunk in responses:
                # An error chunk is the replica's last: its generator has ended, so nothing to cancel
                # (cancelling it anyway costs the replica a traceback for every refusal in a burst).
                finished = chunk.error is not None or chunk.finish_reason is not None
                if chunk.error is not None:
                    refused = chunk.error.kind == "overloaded"
                    raise exception_from_error_info(chunk.error)
                yield chunk
        except BackPressureError as exc:
            refused = True
            raise EngineOverloadedError(f"all engine replicas are busy: {exc}") from exc
        finally:
            if refused:
                self.gate.refused()
            else:  # it ended, one way or another, after the engine took it: a slot is free
                self.gate.ended()
            if not finished:
                responses.cancel()  # the replica's generator is cancelled, which aborts the request

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.serve.exceptions import BackPressureError

        try:
            return await getattr(self._handle, method).remote(*args)
        except BackPressureError as exc:
            raise EngineOverloadedError(f"all engine replicas are busy: {exc}") from exc

    async def _local_tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer rebuilt here (None: the model has none; the engine's calls then
        raise the error that says so)."""
        if not self._tokenizer_fetched:
            async with self._tokenizer_lock:
                if not self._tokenizer_fetched:
                    files = await self._call("tokenizer_files")
                    if files is not None:  # parsing a 2 MB tokenizer.json: off the event loop
                        self._tokenizer = await asyncio.to_thread(Tokenizer.from_files, files)
                    self._tokenizer_fetched = True
        return self._tokenizer

    async def model_info(self) -> ModelInfo:
        return await self._call("model_info")

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        tok = await self._local_tokenizer()
        if tok is None:
            return await self._call("tokenize", text, add_special_tokens)
        return await _off_loop_if_long(lambda: tok.encode(text, add_special_tokens), len(text))

    async def detokenize(self, token_ids: list[int]) -> str:
        tok = await self._local_tokenizer()
        if tok is None or any(not 0 <= t < tok.vocab_size for t in token_ids):  # the engine's error
            return await self._call("detokenize", token_ids)
        return await _off_loop_if_long(lambda: tok.decode(token_ids, False), len(token_ids))

    async def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        tok = await self._local_tokenizer()
        if tok is None:
            return await self._call("tokenize_chat", messages)
        size = sum(len(m["content"]) if isinstance(m.get("content"), str) else INLINE_TOKENIZE_CHARS + 1
                   for m in messages)
        return await _off_loop_if_long(lambda: tok.encode(tok.apply_chat_template(messages)), size)

    async def check_health(self) -> None:
        await self._call("check_health")

    async def admin_status(self) -> dict[str, Any]:
        return await self._call("admin_status")

    async def admin_set(self, update: AdminUpdate) -> dict[str, Any]:
        result = await self._call("admin_set", update)
        if isinstance(result, EngineErrorInfo):  # refused: an error crosses Ray as a value
            raise exception_from_error_info(result)
        return result


def chunk_from_output(output: RequestOutput) -> GenerateChunk:
    """Replica side: the engine's per-step RequestOutput as the chunk that crosses to the ingress."""
    return GenerateChunk(output.request_id, output.text, tuple(output.token_ids), output.finish_reason,
                         output.num_prompt_tokens, output.num_output_tokens,
                         logprobs=output.logprobs, prompt_logprobs=output.prompt_logprobs,
                         num_cached_tokens=output.num_cached_tokens)
