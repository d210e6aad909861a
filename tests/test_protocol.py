"""The OpenAI request models, the chunk -> OpenAI formatting, the ingress <-> engine records and
HandleEngineClient (over a stand-in for a Ray Serve DeploymentHandle), and the FakeEngine itself."""
from __future__ import annotations

import json

import asyncio
import dataclasses
import pickle

import pytest
from pydantic import ValidationError

from deployments import protocol as p
from deployments.engine_client import (AdminUpdate, EngineClient, EngineErrorInfo, EngineInternalError,
                                       GenerateChunk, GenerateRequest, HandleEngineClient, ModelInfo,
                                       error_info_from_exception, exception_from_error_info,
                                       stream_with_error_chunks)
from tests.fakes import FakeEngine
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.sampling_params import SamplingParams


def run(coro):
    return asyncio.run(coro)


async def drain(stream) -> list[GenerateChunk]:
    return [chunk async for chunk in stream]


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


# ---- request models ----------------------------------------------------------------------------

def test_unknown_fields_are_ignored_and_types_are_strict():
    req = p.ChatCompletionRequest.model_validate(chat(some_future_field={"x": 1}, temperature=1))
    assert req.temperature == 1.0
    for bad in ({"temperature": "0.5"}, {"max_tokens": True}, {"stream": "yes"}, {"seed": 1.5}):
        with pytest.raises(ValidationError):
            p.ChatCompletionRequest.model_validate(chat(**bad))


def test_content_parts_are_joined_and_non_text_parts_refused():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert req.chat_messages() == [{"role": "user", "content": "a\nb"}]
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(ValidationError, match="only text"):
        p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": image}]})


def test_sampling_fields_normalize_stop_and_top_k():
    req = p.ChatCompletionRequest.model_validate(chat(stop="END", top_k=0, temperature=0.0, seed=7))
    fields = req.sampling_fields()
    assert fields["stop"] == ("END",) and fields["top_k"] == 0 and fields["temperature"] == 0.0
    assert fields["seed"] == 7 and "top_p" not in fields  # unset fields keep the engine's defaults
    params = SamplingParams.create(max_tokens=4, **fields)  # the engine accepts what the ingress produces
    assert params.top_k == -1  # vLLM's convention: 0 and -1 both mean "disabled"; SamplingParams decides


@pytest.mark.parametrize("extra, param", [
    ({"n": 0}, "n"), ({"top_logprobs": 2}, "top_logprobs"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"best_of": 2}, "best_of"), ({"guided_json": {}}, "guided_json"), ({"parallel_tool_calls": None}, None),
])
def test_refused_chat_fields_name_their_parameter(extra, param):
    req = p.ChatCompletionRequest.model_validate(chat(**extra))
    if param is None:  # its "off" value: accepted
        req.check_supported()
        return
    with pytest.raises(p.UnsupportedFeature) as info:
        req.check_supported()
    assert info.value.param == param


def test_unknown_fields_are_accepted_and_reported():
    req = p.ChatCompletionRequest.model_validate(chat(frobnicate=1, tools=[]))
    req.check_supported()
    assert req.ignored_fields() == ["frobnicate"]


def test_completion_prompt_forms_and_logprob_fields():
    assert p.CompletionRequest.model_validate({"prompt": "one"}).prompts() == ["one"]
    assert p.CompletionRequest.model_validate({"prompt": [5, 6]}).prompts() == [[5, 6]]
    assert p.CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert p.CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    for bad in ("", [], ["a", ""], [1, "a"], 3, [True], [[1], "a", 2]):
        with pytest.raises(ValidationError):
            p.CompletionRequest.model_validate({"model": "m", "prompt": bad})
    echo = p.CompletionRequest.model_validate({"prompt": "x", "echo": True, "logprobs": 2})
    assert echo.logprob_fields() == {"logprobs": 2, "prompt_logprobs": 2}
    chat_req = p.ChatCompletionRequest.model_validate(chat(logprobs=True, top_logprobs=3))
    assert chat_req.logprob_fields() == {"logprobs": 3, "prompt_logprobs": None}


def test_response_format_becomes_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = p.ChatCompletionRequest.model_validate(chat(response_format={"type": "json_schema",
                                                                       "json_schema": {"name": "x", "schema": schema}}))
    spec = req.sampling_fields()["structured_output"]
    assert spec.kind == "json_schema" and json.loads(spec.json_schema) == schema
    assert p.ChatCompletionRequest.model_validate(chat(response_format={"type": "text"})).sampling_fields()[
        "structured_output"] is None


def test_error_body_has_the_openai_shape():
    body = p.error_body(400, "bad", param="temperature")
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": 400}}


# ---- formatting --------------------------------------------------------------------------------

def _chunk(text, finish=None, prompt=3, out=1):
    return GenerateChunk("r", text, (1,) if text else (), finish, prompt, out)


def test_chat_stream_order_and_usage():
    fmt = p.ChatFormatter("chatcmpl-1", "m", include_usage=True, want_logprobs=False)
    choice = p.Choice(0)
    first = fmt.stream(choice, _chunk("a"))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first[1]["choices"][0]["delta"] == {"content": "a"} and first[1]["usage"] is None
    last = fmt.stream(choice, _chunk("b", "length", out=2))
    assert [c["choices"][0]["delta"] for c in last[:2]] == [{"content": "b"}, {}]
    assert last[1]["choices"][0]["finish_reason"] == "length"
    usage = fmt.usage_chunk(p.usage_of([3], {0: _chunk("b", "length", out=2)}))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}


def test_usage_counts_each_prompts_cached_tokens_once_from_its_first_choice():
    # Two prompts of 40 and 50 tokens, n=2: choices 0, 1 are the first prompt's, 2, 3 the second's. A
    # prompt's second choice finds it cached because of its first; usage counts the prompt once.
    chunks = {i: GenerateChunk("r", "", (), "length", prompt, 4, num_cached_tokens=cached)
              for i, (prompt, cached) in enumerate([(40, 16), (40, 32), (50, 0), (50, 48)])}
    usage = p.usage_of([40, 50], chunks)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (90, 16, 16)


def test_stream_chunks_carry_no_usage_key_unless_asked():
    chat_fmt = p.ChatFormatter("c", "m", include_usage=False, want_logprobs=False)
    comp_fmt = p.CompletionFormatter("c", "m", include_usage=False, want_logprobs=False)
    for out in (chat_fmt.stream(p.Choice(0), _chunk("a", "stop")), comp_fmt.stream(p.Choice(0), _chunk("a", "stop"))):
        assert out and all("usage" not in c for c in out)


def test_completion_logprobs_shape_with_echo():
    from engine.logprobs import PositionLogprobs, TokenLogprob
    pos = PositionLogprobs(TokenLogprob(7, -0.5, 2, "b"), (TokenLogprob(8, -0.1, 1, "c"),))
    body = p.CompletionFormatter("c", "m", False, True).body(
        [p.Choice(0, echo="ab", first_token="a", text="b", logprobs=[None, pos], finish_reason="length")],
        p.Usage.of(1, 1))
    lps = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "abb"
    assert lps == {"tokens": ["a", "b"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {"c": -0.1, "b": -0.5}],
                   "text_offset": [0, 1]}


# ---- records crossing the Ray boundary ---------------------------------------------------------

def test_records_pickle_and_are_frozen():
    req = GenerateRequest("r1", (1, 2), 8, temperature=0.0, stop=("x",))
    chunk = GenerateChunk("r1", "a", (3,), None, 2, 1, EngineErrorInfo("invalid_request", "m", "seed"))
    for record in (req, chunk, ModelInfo("m", 128, 256, (2,), 0), AdminUpdate(mode="accuracy")):
        assert pickle.loads(pickle.dumps(record)) == record
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.max_tokens = 9  # type: ignore[misc]


@pytest.mark.parametrize("exc, cls", [(InvalidRequestError("bad seed", param="seed"), InvalidRequestError),
                                      (EngineOverloadedError("full"), EngineOverloadedError),
                                      (EngineDeadError("dead"), EngineDeadError),
                                      (KeyError("boom"), EngineInternalError)])
def test_errors_round_trip_through_error_info(exc, cls):
    back = exception_from_error_info(pickle.loads(pickle.dumps(error_info_from_exception(exc))))
    assert type(back) is cls and str(exc) in str(back)
    if cls is InvalidRequestError:
        assert back.param == "seed"


def test_stream_with_error_chunks_ends_with_the_error():
    engine = FakeEngine()
    engine.inject_fault(InvalidRequestError("no", param="top_k"), after_tokens=2)
    req = GenerateRequest("r", (65, 66, 67, 68), 10)
    chunks = run(drain(stream_with_error_chunks(req, engine.generate(req))))
    assert [c.text for c in chunks[:2]] == ["A", "B"] and chunks[-1].error is not None
    assert chunks[-1].error.param == "top_k" and chunks[-1].num_output_tokens == 2


# ---- HandleEngineClient over a stand-in handle -------------------------------------------------

class FakeReplica:
    """What the engine replica deployment exposes: generate yields chunks, errors as chunks."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def generate(self, request):
        return stream_with_error_chunks(request, self.engine.generate(request))

    def __getattr__(self, name):
        return getattr(self.engine, name)


class FakeResponseGenerator:
    def __init__(self, agen, reject):
        self._agen, self._reject, self.cancelled = agen, reject, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._reject is not None:
            raise self._reject
        return await self._agen.__anext__()

    def cancel(self):
        self.cancelled = True
        asyncio.get_event_loop().create_task(self._agen.aclose())


class FakeHandle:
    """Mimics DeploymentHandle: handle.options(stream=True).method.remote(*args)."""

    def __init__(self, replica, stream=False, reject=None):
        self.replica, self.stream, self.reject, self.responses = replica, stream, reject, []

    def options(self, stream=False):
        clone = FakeHandle(self.replica, stream, self.reject)
        clone.responses = self.responses
        return clone

    def stream_for(self, agen):
        """The response generator of the next streaming call (DyingHandle scripts deaths here)."""
        return FakeResponseGenerator(agen, self.reject)

    def __getattr__(self, name):
        fn, handle = getattr(self.replica, name), self

        class Method:
            @staticmethod
            def remote(*args):
                if handle.stream:
                    handle.responses.append(handle.stream_for(fn(*args)))
                    return handle.responses[-1]

                async def call():
                    if handle.reject is not None:
                        raise handle.reject
                    return await fn(*args)
                return call()
        return Method()


def test_handle_client_streams_and_raises_engine_errors():
    engine = FakeEngine()
    client = HandleEngineClient(FakeHandle(FakeReplica(engine)))
    assert isinstance(client, EngineClient) and isinstance(engine, EngineClient)
    req = GenerateRequest("r", (72, 105), 10)
    chunks = run(drain(client.generate(req)))
    assert "".join(c.text for c in chunks) == "Hi" and chunks[-1].finish_reason == "stop"
    assert run(client.tokenize("ab")) == [97, 98] and run(client.model_info()).served_model_name == "fake-echo"
    bad = GenerateRequest("r2", (72,), 10, top_p=2.0)  # the engine's SamplingParams refuses it
    with pytest.raises(InvalidRequestError) as info:
        run(drain(client.generate(bad)))
    assert info.value.param == "top_p"


def test_handle_client_maps_ray_back_pressure_to_overloaded():
    from ray.serve.exceptions import BackPressureError

    client = HandleEngineClient(FakeHandle(FakeReplica(FakeEngine()), reject=BackPressureError(
        num_queued_requests=5, max_queued_requests=5)))
    with pytest.raises(EngineOverloadedError):
        run(drain(client.generate(GenerateRequest("r", (72,), 4))))
    with pytest.raises(EngineOverloadedError):
        run(client.tokenize_chat([{"role": "user", "content": "x"}]))


def test_handle_client_cancels_the_replica_stream_when_closed_early():
    engine = FakeEngine()
    handle = FakeHandle(FakeReplica(engine))
    client = HandleEngineClient(handle)

    async def read_one_then_close():
        stream = client.generate(GenerateRequest("r", (72, 105, 33), 10))
        await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0)  # let the cancellation task the handle scheduled run
    run(read_one_then_close())
    assert handle.responses[0].cancelled and engine.aborted == ["r"]


class DyingStream(FakeResponseGenerator):
    """A replica stream that dies (Ray's ActorDiedError) after `chunks` chunks."""

    def __init__(self, agen, chunks: int):
        super().__init__(agen, None)
        self.left = chunks

    async def __anext__(self):
        from ray.exceptions import ActorDiedError

        if self.left == 0:
            raise ActorDiedError()
        self.left -= 1
        return await super().__anext__()


class DyingHandle(FakeHandle):
    """The first len(deaths) generate streams die after deaths[i] chunks; later ones are healthy."""

    def __init__(self, replica, deaths: list[int]):
        super().__init__(replica, stream=True)
        self.deaths = deaths

    def options(self, stream=False):
        return self

    def stream_for(self, agen):
        calls = len(self.responses)
        return DyingStream(agen, self.deaths[calls]) if calls < len(self.deaths) else super().stream_for(agen)


def test_a_request_whose_replica_died_before_answering_goes_again():
    from deployments.engine_client import REPLICA_LOST_RETRIES

    handle = DyingHandle(FakeReplica(FakeEngine()), deaths=[0] * REPLICA_LOST_RETRIES)
    chunks = run(drain(HandleEngineClient(handle).generate(GenerateRequest("r", (72, 105), 10))))
    assert "".join(c.text for c in chunks) == "Hi" and chunks[-1].finish_reason == "stop"
    assert len(handle.responses) == REPLICA_LOST_RETRIES + 1


def test_a_request_is_not_sent_again_once_it_streamed_or_past_the_retries():
    from ray.exceptions import RayActorError

    from deployments.engine_client import REPLICA_LOST_RETRIES

    started = DyingHandle(FakeReplica(FakeEngine()), deaths=[1])  # one chunk reached the client, then death
    with pytest.raises(RayActorError):
        run(drain(HandleEngineClient(started).generate(GenerateRequest("r", (72, 105, 33), 10))))
    assert len(started.responses) == 1
    dead = DyingHandle(FakeReplica(FakeEngine()), deaths=[0] * (REPLICA_LOST_RETRIES + 1))
    with pytest.raises(RayActorError):
        run(drain(HandleEngineClient(dead).generate(GenerateRequest("r", (72,), 4))))
    assert len(dead.responses) == REPLICA_LOST_RETRIES + 1


# ---- FakeEngine behaviour ----------------------------------------------------------------------

def test_fake_engine_stop_strings_stop_ids_and_ignore_eos():
    engine = FakeEngine()
    ids = tuple(ord(c) for c in "abcdef")
    out = run(drain(engine.generate(GenerateRequest("a", ids, 20, stop=("cd",)))))
    assert "".join(c.text for c in out) == "ab" and out[-1].finish_reason == "stop"
    out = run(drain(engine.generate(GenerateRequest("b", ids, 20, stop_token_ids=(ord("c"),)))))
    assert "".join(c.text for c in out) == "ab" and out[-1].finish_reason == "stop"
    out = run(drain(engine.generate(GenerateRequest("c", ids, 9, ignore_eos=True))))
    assert "".join(c.text for c in out) == "abcdefabc" and out[-1].finish_reason == "length"
    assert engine.finished == ["a", "b", "c"] and engine.aborted == [] and not engine.in_flight


def test_fake_engine_refuses_beyond_its_queue_limit():
    engine = FakeEngine(queue_limit=1)

    async def two_at_once():
        first = engine.generate(GenerateRequest("a", (65, 66), 4))
        await anext(first)
        with pytest.raises(EngineOverloadedError):
            await anext(engine.generate(GenerateRequest("b", (65,), 4)))
        await first.aclose()
    run(two_at_once())
    assert engine.aborted == ["a"]


def test_chunk_from_engine_output():
    from deployments.engine_client import chunk_from_output
    from engine.outputs import RequestOutput

    out = RequestOutput("r", "hi", (5, 6), 3, 2, "length", 0.0, 0.1, 0.2)
    assert chunk_from_output(out) == GenerateChunk("r", "hi", (5, 6), "length", 3, 2)


def test_handle_client_raises_a_refused_admin_update_with_its_param():
    class RefusingReplica(FakeReplica):
        async def admin_set(self, update):  # what LLMServer returns for an impossible pin
            return EngineErrorInfo("invalid_request", "quantized_layers must be in [0, 30]", "quantized_layers")

    client = HandleEngineClient(FakeHandle(RefusingReplica(FakeEngine())))
    with pytest.raises(InvalidRequestError) as info:
        run(client.admin_set(AdminUpdate(quantized_layers=1000)))
    assert info.value.param == "quantized_layers" and "[0, 30]" in str(info.value)
    assert run(HandleEngineClient(FakeHandle(FakeReplica(FakeEngine()))).admin_set(AdminUpdate(mode="accuracy")))["mode"] == "accuracy"


# ---- tokenizing in the ingress, and the overload gate --------------------------------------------

def _word_tokenizer_files():
    """A small real tokenizer (word level) with a chat template, as the engine replica would send it."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from engine.tokenizer import TokenizerFiles

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "user:", "hello", "there", "assistant:"])}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}assistant:"
    return TokenizerFiles(tok.to_str(), {"eos_token": "<eos>"}, {}, template)


class TokenizingReplica(FakeReplica):
    """A replica that has a tokenizer to share and counts the calls that reach it."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls = []

    async def tokenizer_files(self):
        self.calls.append("tokenizer_files")
        return _word_tokenizer_files()

    async def tokenize_chat(self, messages):
        self.calls.append("tokenize_chat")
        return await self.engine.tokenize_chat(messages)

    async def tokenize(self, text, add_special_tokens=False):
        self.calls.append("tokenize")
        return await self.engine.tokenize(text, add_special_tokens)


def test_handle_client_tokenizes_with_its_own_copy_fetched_once():
    replica = TokenizingReplica(FakeEngine())
    client = HandleEngineClient(FakeHandle(replica))

    async def three():
        ids = await client.tokenize_chat([{"role": "user", "content": "hello there"}])
        return ids, await client.tokenize("there hello"), await client.detokenize([3, 4])
    ids, plain, text = run(three())
    assert ids == [2, 3, 4, 5] and plain == [4, 3] and text == "hello there"
    assert replica.calls == ["tokenizer_files"]  # no tokenize call crossed to the engine


def test_handle_client_without_engine_tokenizer_asks_the_engine():
    client = HandleEngineClient(FakeHandle(FakeReplica(FakeEngine())))  # FakeEngine has no tokenizer files
    assert run(client.tokenize_chat([{"role": "user", "content": "ab"}])) == [97, 98]


def test_gate_refuses_here_after_an_engine_refusal_until_a_generation_ends():
    engine = FakeEngine(queue_limit=1, token_delay_s=0.01)
    replica = FakeReplica(engine)
    client = HandleEngineClient(FakeHandle(replica), refusal_hold_s=60.0)

    async def burst():
        first = client.generate(GenerateRequest("a", (65, 66, 67), 3, ignore_eos=True))
        await anext(first)
        with pytest.raises(EngineOverloadedError):  # the engine refuses: it holds one request
            await anext(client.generate(GenerateRequest("b", (65,), 3)))
        seen = len(engine.requests)
        with pytest.raises(EngineOverloadedError, match="none has finished one since"):
            await anext(client.generate(GenerateRequest("c", (65,), 3)))
        assert len(engine.requests) == seen  # refused here, without a call into the engine
        await drain(first)  # "a" ends: a slot is free, the gate opens
        return await drain(client.generate(GenerateRequest("d", (65,), 2, ignore_eos=True)))
    chunks = run(burst())
    assert chunks[-1].finish_reason == "length" and client.gate.refused_here == 1


def test_gate_is_off_with_zero_hold():
    engine = FakeEngine(queue_limit=1, token_delay_s=0.01)
    client = HandleEngineClient(FakeHandle(FakeReplica(engine)))

    async def burst():
        first = client.generate(GenerateRequest("a", (65, 66), 2))
        await anext(first)
        for rid in "bc":
            with pytest.raises(EngineOverloadedError):
                await anext(client.generate(GenerateRequest(rid, (65,), 2)))
        await first.aclose()
    run(burst())
    assert client.gate.refused_here == 0
