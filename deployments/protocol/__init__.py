"""The OpenAI wire format, one file per concept:

    errors.py      the error body and UnsupportedFeature
    requests.py    request bodies (completions, chat, admin), strict on types, shapes only
    responses.py   response bodies and stream chunks
    formatting.py  engine chunks -> response bodies and stream chunks

Request *meaning* (ranges, sampling semantics) is validated once, by engine/sampling_params.py.
"""
from deployments.protocol.errors import ERROR_TYPES, ErrorDetail, ErrorResponse, UnsupportedFeature, error_body
from deployments.protocol.formatting import (chat_body, chat_stream_renderer, completion_body,
                                             completion_stream_renderer)
from deployments.protocol.requests import (ChatCompletionRequest, ChatMessage, CompletionRequest, MorphAdminRequest,
                                           StreamOptions, TextPart)
from deployments.protocol.responses import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse,
                                            ChatDelta, ChatStreamChoice, CompletionChoice, CompletionResponse,
                                            ModelCard, ModelList, Usage)

__all__ = ["ERROR_TYPES", "ErrorDetail", "ErrorResponse", "UnsupportedFeature", "error_body", "chat_body",
           "chat_stream_renderer", "completion_body", "completion_stream_renderer", "ChatCompletionRequest",
           "ChatMessage", "CompletionRequest", "MorphAdminRequest", "StreamOptions", "TextPart",
           "AssistantMessage", "ChatChoice", "ChatCompletionChunk", "ChatCompletionResponse", "ChatDelta",
           "ChatStreamChoice", "CompletionChoice", "CompletionResponse", "ModelCard", "ModelList", "Usage"]
