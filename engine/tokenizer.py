"""Tokenizer (encode / decode / chat template) over the `tokenizers` library, and IncrementalDetokenizer
for streaming. transformers is not imported here: it takes seconds to import and is not needed at run time.

The chat template is the model's own Jinja template, rendered in a sandbox the way Hugging Face renders
it (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `tojson`), so prompts match what the
model was trained on.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError, ModelLoadError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path} ({e}); re-download or re-convert the model") from e


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation (e.g. "roles must alternate").
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # HF's variant: no HTML escaping (jinja's built-in would turn '<' into \u003c), unicode kept.
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _template_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the message list and flatten OpenAI-style text parts into one string per message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequestError(f"messages[{i}].content may only hold text parts "
                                          f"({{'type': 'text', 'text': ...}})", param="messages")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts",
                                      param="messages")
        out.append({**m, "content": content})
    return out


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer as plain values (what its files hold), so it pickles across processes: the HTTP
    ingress rebuilds the engine's tokenizer from it and tokenizes without a call into the engine."""
    tokenizer_json: str  # tokenizer.json's text
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]
    chat_template: str | None


class Tokenizer:
    """A model's tokenizer: `tokenizers.Tokenizer` plus what tokenizer_config / generation_config add."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, tokenizer_config: dict[str, Any],
                 generation_config: dict[str, Any], chat_template: str | None):
        self._tok = tokenizer
        self._configs = (tokenizer_config, generation_config)
        self.bos_token = _token_text(tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(tokenizer_config.get("eos_token"))
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None
        bos = generation_config.get("bos_token_id")
        self.bos_token_id: int | None = int(bos) if bos is not None else self._token_id(self.bos_token)
        eos = _ids(generation_config.get("eos_token_id"))
        eos_from_config = self._token_id(self.eos_token)
        if eos_from_config is not None:
            eos.append(eos_from_config)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

    @classmethod
    def from_dir(cls, hf_dir: str | Path) -> "Tokenizer":
        hf_dir = Path(hf_dir)
        path = hf_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{hf_dir} has no tokenizer.json; add the model's tokenizer files to the folder "
                                 f"(or serve it from its .gguf file, which carries its tokenizer)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ModelLoadError(f"cannot load {path} ({e}); re-download or re-convert the model") from e
        tok_cfg = _read_json(hf_dir / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        jinja_file = hf_dir / "chat_template.jinja"  # transformers >= 4.50 may keep it beside the config
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(tok, tok_cfg, _read_json(hf_dir / "generation_config.json"), template)

    def files(self) -> TokenizerFiles:
        return TokenizerFiles(self._tok.to_str(), *self._configs, self.chat_template)

    @classmethod
    def from_files(cls, files: TokenizerFiles) -> "Tokenizer":
        """The tokenizer `files()` describes (encodes and renders chats exactly as the original)."""
        return cls(tokenizers.Tokenizer.from_str(files.tokenizer_json), files.tokenizer_config,
                   files.generation_config, files.chat_template)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object itself (what grammar libraries build their vocabulary view from)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}", param="prompt")
        # encode_batch, not encode: only the batch call releases the GIL while the Rust side works,
        # so a long prompt tokenized on a worker thread leaves the caller's event loop running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the model's chat template. Raises InvalidRequestError for a malformed conversation."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt to /v1/completions",
                                      param="messages")
        normalized = _normalize_messages(messages)
        try:
            if self._compiled is None:
                self._compiled = _template_env().from_string(self.chat_template)
            return self._compiled.render(messages=normalized, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected the messages: {e}", param="messages") from e


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Decoding token by token is wrong twice over: byte-level BPE spreads one character over several
    tokens (a lone token decodes to U+FFFD), and SentencePiece decoders render a token's leading space
    only after a previous token. So we decode a short window: ids[prefix:read] is text already emitted
    (context), ids[prefix:] is the same plus what is new; the delta is emitted once it no longer ends in
    U+FFFD, i.e. once the character is complete.
    """

    _PROMPT_CONTEXT = 6  # prompt tokens kept as left context for the first generated token

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])[-self._PROMPT_CONTEXT:]
        self._prefix = 0  # window start (context only)
        self._read = len(self._ids)  # ids before this index are already reflected in self.text
        self._text = ""

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the newly completed text ('' while a character is incomplete)."""
        self._ids.extend(int(t) for t in token_ids)
        context = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip)
        window = self._tokenizer.decode(self._ids[self._prefix:], self._skip)
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return ""
        delta = window[len(context):]
        self._prefix, self._read = self._read, len(self._ids)
        self._text += delta
        return delta
