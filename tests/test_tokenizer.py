"""Tokenizer and IncrementalDetokenizer on the default model's converted tokenizer, checked against
transformers' own GGUF tokenizer loading."""
from __future__ import annotations

import json

import pytest
import tokenizers

from engine.errors import InvalidRequestError, ModelLoadError
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! The answer is 42.",
    "  leading spaces,\ttabs\nand newlines 3.14159",
    "naïve café, Ünïcödé — “quotes” ½",
    "日本語のテキストと中文文本。한국어도.",
    "emoji: 🤖🎉 family 👩‍👩‍👧 flag 🇫🇷 done",
]


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' tokenizer built straight from the GGUF: the independent reference."""
    from transformers import AutoTokenizer

    from engine.default_model import default_gguf_path

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_special_ids_and_vocab(tok):
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.vocab_size == 49152
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.decode([2]) == ""


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_encode_matches_transformers_gguf_tokenizer(tok, hf_tok):
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    # Special tokens written in the text are recognised as single ids (chat prompts rely on it).
    assert tok.encode("<|im_start|>user")[0] == 1


def test_chat_template_matches_transformers(tok, hf_tok):
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Capital of France? 🇫🇷"}]
    for gen in (True, False):
        want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
    # No system message: the template inserts its default one.
    solo = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(solo) == hf_tok.apply_chat_template(solo, tokenize=False, add_generation_prompt=True)


def test_files_round_trip_through_pickle_to_the_same_tokenizer(tok):
    """What the ingress rebuilds from the engine's TokenizerFiles encodes and renders exactly alike."""
    import pickle

    from engine.tokenizer import TokenizerFiles

    files = pickle.loads(pickle.dumps(tok.files()))
    assert isinstance(files, TokenizerFiles)
    copy = Tokenizer.from_files(files)
    messages = [{"role": "user", "content": TEXTS[2]}]
    assert copy.apply_chat_template(messages) == tok.apply_chat_template(messages)
    for text in TEXTS:
        assert copy.encode(text) == tok.encode(text)
        assert copy.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True)
    assert (copy.eos_token_ids, copy.bos_token_id, copy.vocab_size) == (tok.eos_token_ids, tok.bos_token_id, tok.vocab_size)


def test_text_parts_are_flattened(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello there"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    [{"content": "no role"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
])
def test_malformed_messages_are_invalid_requests(tok, messages):
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(messages)
    assert info.value.param == "messages"


def _bare(template: str | None) -> Tokenizer:
    return Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), {"eos_token": "</s>"}, {}, template)


def test_template_errors_are_invalid_requests():
    strict = _bare("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
                   "{% endif %}{{ messages[0]['content'] }}")
    assert strict.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="chat template rejected"):
        _bare("{{ messages[0].nope.deeper }}").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        _bare(None).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sees_eos_and_tojson():
    t = _bare("{{ messages | tojson }}{{ eos_token }}")
    assert t.apply_chat_template([{"role": "user", "content": "<é>"}]) == json.dumps(
        [{"role": "user", "content": "<é>"}], ensure_ascii=False) + "</s>"


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_token_by_token(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("<|im_start|>assistant\n"))
    chunks = [detok.push([i]) for i in ids]
    assert "".join(chunks) == text and detok.text == text
    assert not any("\ufffd" in c for c in chunks)


def test_incremental_detokenizer_holds_back_partial_characters(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # one emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🤖"


def test_incremental_detokenizer_chunks_and_special_tokens(tok):
    text = "Bonjour 世界! 🎉"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    out = detok.push(ids[:3]) + detok.push(ids[3:]) + detok.push([2])  # 2 = <|im_end|>, skipped
    assert out == text and detok.text == text
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert keep.push(ids) + keep.push([2]) == text + "<|im_end|>"
