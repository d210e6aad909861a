"""The OpenAI wire format, one file per concept:

    errors.py      the error body and UnsupportedFeature
    requests.py    request bodies (completions, chat, admin), strict on types, shapes only
    responses.py   response bodies and stream chunks
    formatting.py  engine chunks -> response bodies and stream chunks (several choices per request)
    logprobs.py    engine logprobs -> the completions and chat logprobs shapes

Request *meaning* (ranges, sampling semantics) is validated once, by engine/sampling_params.py.
"""
from deployments.protocol.errors import ERROR_TYPES, ErrorDetail, ErrorResponse, UnsupportedFeature, error_body
from deployments.protocol.formatting import ChatFormatter, Choice, CompletionFormatter, usage_of
from deployments.protocol.requests import (REFUSED, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                           MorphAdminRequest, ResponseFormat, StreamOptions, TextPart,
                                           TokenizeRequest, DetokenizeRequest)
from deployments.protocol.responses import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse,
                                            ChatDelta, ChatStreamChoice, CompletionChoice, CompletionResponse,
                                            ModelCard, ModelList, Usage)

__all__ = ["ERROR_TYPES", "ErrorDetail", "ErrorResponse", "UnsupportedFeature", "error_body", "ChatFormatter", "Choice",
           "CompletionFormatter", "usage_of", "REFUSED", "ResponseFormat", "TokenizeRequest", "DetokenizeRequest", "ChatCompletionRequest",
           "ChatMessage", "CompletionRequest", "MorphAdminRequest", "StreamOptions", "TextPart",
           "AssistantMessage", "ChatChoice", "ChatCompletionChunk", "ChatCompletionResponse", "ChatDelta",
           "ChatStreamChoice", "CompletionChoice", "CompletionResponse", "ModelCard", "ModelList", "Usage"]
