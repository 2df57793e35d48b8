"""Request and response schemas of the OpenAI-compatible API, as msgspec structs.

Request bodies are decoded straight into these structs (``msgspec.json.decode(body,
type=...)``): a wrong type is a ``msgspec.ValidationError`` naming the JSON path, which the
app turns into a 400. Unknown fields are ignored (clients send fields we do not use, e.g.
``user``); ranges are checked where the engine's ``SamplingParams`` is built, so each bad
value is reported with the request field's name.

Responses are structs too: msgspec encodes them several times faster than ``json.dumps`` of
dicts, which matters for one SSE chunk per token.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# ============================================================================ requests


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"  # a JSON object, as a string (OpenAI)


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _UnimplementedFields(msgspec.Struct, kw_only=True):
    """Fields of OpenAI's and vLLM's APIs this server does not implement: declared so that each
    is either refused when used or knowingly ignored (``server/unsupported.py`` has the rule and
    the list; docs/server.md the table). Fields no one declares are ignored."""

    best_of: int | None = None
    reasoning_effort: str | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # vLLM's extras
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[Any] | None = None
    # informational: accepted and ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class _SamplingFields(_UnimplementedFields, kw_only=True):
    """Sampling fields shared by chat and completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # extras (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None
    return_token_ids: bool = False  # vLLM's extra: each choice (and each chunk) carries its token ids
    prompt_logprobs: int | None = None  # vLLM's extra: log-probabilities of the prompt tokens
    # accepted so that a request using them gets a clear 400 instead of being silently ignored
    # (logit_bias: by the rule in unsupported.py)
    logit_bias: dict[str, float] | None = None
    # structured outputs (server/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # Jinja text rendering this request instead of the model's


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a text, token ids, or a batch of either (checked by the server)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# ============================================================================ responses


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """The legacy completions shape: parallel lists per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """One token's entry in vLLM's ``prompt_logprobs`` (keyed by its token id)."""

    logprob: float
    rank: int
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt position, None for the first, else token id -> entry
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # the model's reasoning (a reasoning parser is on)


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "deltaserve"
    root: str | None = None
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo
