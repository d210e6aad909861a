"""`python -m engine.cli chat "prompt"`: stream one chat answer from the engine alone (no Ray)."""
from __future__ import annotations

import argparse
import sys

from engine.errors import MorphServeError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.cli", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="stream a chat answer to stdout")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--model", default="default", help="'default', a Hugging Face folder or a .gguf file")
    chat.add_argument("--dtype", default="auto", help="auto, bf16, fp16 or fp32")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--memory-budget", default="1GiB", help="e.g. 1GiB, 512MiB")
    chat.add_argument("--max-model-len", type=int, default=2048)
    chat.add_argument("--system", default=None, help="optional system message")
    return parser


def chat(args: argparse.Namespace, out=sys.stdout) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    params = SamplingParams.create(max_tokens=args.max_tokens, temperature=args.temperature,
                                   top_p=args.top_p, seed=args.seed)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, memory_budget=args.memory_budget,
                                    max_model_len=args.max_model_len, enable_morphing=False))
    if engine.tokenizer is None:
        raise MorphServeError(f"model {args.model!r} has no tokenizer; chat needs one")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    engine.add_request("cli-0", engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True), params)
    try:
        while engine.has_unfinished():
            for output in engine.step().outputs:
                out.write(output.text)
                out.flush()
    finally:
        engine.close()
    out.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return chat(args)
    except (MorphServeError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
