"""InputProcessor: a request's input checked, tokenized and built into a ``Request``. Torch-free.

Built from a tokenizer and the engine's limits (``max_model_len``, ``vocab_size``, the longest
vocabulary entry, the salt parts the cache hashes with), so the engine and a cluster ingress
refuse the same input with the same typed errors (``InvalidRequestError``,
``PromptTooLongError``). It is the front door of every placement: the model's sampling defaults
(``sampling_defaults``, from ``generation_config.json``) fill the ``SamplingParams`` fields a
request left unset here and nowhere else, and a request's own ``chat_template`` replaces the
tokenizer's for that request only. Every value a request carries is range-checked here: nothing accepted
can fail a step later. Request-id uniqueness is not checked here: it is the engine's state.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from deltaserve.cache.hashing import make_salt
from deltaserve.engine.errors import InvalidRequestError, PromptTooLongError
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.scheduler.request import Request

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]

#: longest request_id / cache_salt accepted
MAX_NAME_CHARS = 1024

#: apply_chat_template arguments a request may not set through chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "return_dict",
     "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
     "tokenizer_kwargs", "continue_final_message"}
)  # fmt: skip


class RequestInput(msgspec.Struct, kw_only=True):
    """One request as ``generate`` receives it (``AsyncEngine.generate`` documents each field)."""

    prompt: Any  # a str, a list of token ids, or chat messages
    sampling_params: SamplingParams | None = None
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None


def short_repr(value: object, limit: int = 60) -> str:
    """repr() of a value cut to ``limit`` characters (a 5,000-digit int must not flood a message)."""
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**30
        else f"<int of {len(str(value))} digits>"
    )
    return text if len(text) <= limit else text[: limit - 3] + "..."


def template_kwargs(
    tools: Sequence[dict[str, Any]] | None, chat_template_kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    """Checked keyword arguments for ``apply_chat_template`` (``add_generation_prompt`` defaults on)."""
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRequestError(
                f"tools must be a list of objects (function schemas), got {short_repr(tools)}"
            )
        if tools:
            kwargs["tools"] = list(tools)
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict) or not all(
            isinstance(k, str) for k in chat_template_kwargs
        ):
            raise InvalidRequestError(
                f"chat_template_kwargs must be an object with string keys, got {short_repr(chat_template_kwargs)}"
            )
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}")
        kwargs.update(chat_template_kwargs)
    return kwargs


def check_name(field: str, value: object) -> None:
    """``request_id`` / ``cache_salt``: a non-empty str of at most ``MAX_NAME_CHARS`` characters."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise InvalidRequestError(
            f"{field} must be a non-empty str of at most {MAX_NAME_CHARS} characters, got {short_repr(value)}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{field} is not valid Unicode text ({e.reason} at index {e.start})"
        ) from None


#: the key under which a transformers tokenizer records that it gave its "Token indices sequence
#: length is longer than the specified maximum sequence length ... will result in indexing
#: errors" warning (it gives it once per tokenizer, when this key is not set)
_LENGTH_WARNING_KEY = "sequence-length-is-longer-than-the-specified-maximum"


def quiet_length_warning(tokenizer: Any) -> None:
    """Mark ``tokenizer``'s too-long-sequence warning as given, so it is never logged: a prompt's
    length is ``InputProcessor``'s to judge (``max_model_len``, ``PromptTooLongError``), and the
    tokenizer's ``model_max_length`` is not ours. Its other warnings are untouched."""
    given = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(given, dict):
        given[_LENGTH_WARNING_KEY] = True


def longest_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry: no token covers more characters of text."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class InputProcessor:
    """Validation, tokenization (chat templates included) and request building (module docstring).

    ``salt_parts`` are what the prefix cache's salt is made of besides a request's own
    ``cache_salt`` (model path, dtype, ``cache.namespace``); ``max_token_chars`` defaults to the
    tokenizer's longest vocabulary entry.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int,
        vocab_size: int,
        salt_parts: Sequence[str],
        max_token_chars: int | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        quiet_length_warning(tokenizer)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_model_len = int(max_model_len)
        self.vocab_size = int(vocab_size)
        self.salt_parts = tuple(salt_parts)
        self.max_token_chars = int(max_token_chars) if max_token_chars else longest_token_chars(tokenizer)
        self._ids = itertools.count()

    def for_another_thread(self) -> InputProcessor:
        """The same checks over a copy of the tokenizer, for one other thread: a fast tokenizer
        must not encode on two threads at once ("Already borrowed")."""
        return InputProcessor(
            copy.deepcopy(self.tokenizer),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            salt_parts=self.salt_parts,
            max_token_chars=self.max_token_chars,
            sampling_defaults=self.sampling_defaults,
        )

    # ------------------------------------------------------------------ requests
    def process(self, inp: RequestInput) -> Request:
        """Validate and build a request (raises InvalidRequestError / PromptTooLongError).

        ``priority`` in [-2**31, 2**31), ``cache_salt`` a str of at most ``MAX_NAME_CHARS``
        characters (or None), ``request_id`` likewise (or None: one is generated).
        """
        params = inp.sampling_params if inp.sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params = params.with_defaults(self.sampling_defaults)
        priority = inp.priority
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) <= priority < 2**31:
            raise InvalidRequestError(
                f"priority must be an int in [-2**31, 2**31), got {short_repr(priority)}"
            )
        if inp.cache_salt is not None:
            check_name("cache_salt", inp.cache_salt)
        if inp.request_id is not None:
            check_name("request_id", inp.request_id)
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"stop token id {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        ids = self.tokenize(
            inp.prompt,
            tools=inp.tools,
            chat_template_kwargs=inp.chat_template_kwargs,
            chat_template=inp.chat_template,
        )
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} (room for at least one "
                f"generated token is needed)"
            )
        rid = (
            inp.request_id if inp.request_id is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        )
        return Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=params,
            priority=priority,
            cache_salt=make_salt(*self.salt_parts, inp.cache_salt),
        )

    # ------------------------------------------------------------------ tokens
    def tokenize(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """Token ids of a str, a list of token ids, or chat messages; typed errors.

        Chat messages are dicts with a string ``role`` and a ``content`` that is a string, a
        list of text parts (``{"type": "text", "text": ...}``, joined with newlines), or None
        when the message carries ``tool_calls``; other keys (``tool_calls``, ``tool_call_id``,
        ``name``, ...) reach the chat template as they are. ``tools`` (function schemas) and
        ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``) are passed to the
        template; ``chat_template`` (Jinja text) renders instead of the tokenizer's template;
        they apply to chat messages only.

        A text prompt that cannot fit in ``max_model_len`` tokens whatever the tokenizer does
        (longer than ``max_model_len`` x the longest vocabulary entry) is refused before it is
        tokenized, so an oversized input never blocks the caller.
        """
        is_chat = (
            isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)
        )
        if (
            tools is not None or chat_template_kwargs is not None or chat_template is not None
        ) and not is_chat:
            raise InvalidRequestError(
                "tools, chat_template and chat_template_kwargs apply to chat messages only"
            )
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise InvalidRequestError(
                f"chat_template must be non-empty text, got {short_repr(chat_template)}"
            )
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            self._check_text("prompt", prompt)
            return self._encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(
                f"prompt must be a str, a list of token ids or a list of chat messages, got {type(prompt).__name__}"
            )
        if len(prompt) == 0:
            raise InvalidRequestError("prompt is empty")
        if is_chat:
            return self._encode(self._render_chat(prompt, tools, chat_template_kwargs, chat_template))  # type: ignore[arg-type]
        return self._token_ids(prompt)  # type: ignore[arg-type]

    def _token_ids(self, prompt: Sequence[int]) -> list[int]:
        """A prompt given as token ids, each checked against the vocabulary."""
        if len(prompt) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}"
            )
        ids = list(prompt)
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise InvalidRequestError(f"prompt token {i} is {t!r}, not an int")
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token {i} = {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        return ids

    def _render_chat(
        self,
        prompt: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        chat_template: str | None = None,
    ) -> str:
        """Chat messages rendered to text by ``chat_template`` (None: the tokenizer's)."""
        messages = [self._chat_message(i, m) for i, m in enumerate(prompt)]
        kwargs = template_kwargs(tools, chat_template_kwargs)
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        extra_chars = len(repr(tools)) if tools else 0
        self._check_length(sum(len(m["content"]) for m in messages) + extra_chars, "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # no template, or the template rejects these messages
            raise InvalidRequestError(f"chat template could not render the messages: {e}") from e
        if not isinstance(text, str):
            raise InvalidRequestError(f"chat template rendered {type(text).__name__}, not text")
        return text

    def _chat_message(self, i: int, m: dict[str, Any]) -> dict[str, Any]:
        """Message ``i`` as the template gets it: string role and content (text parts joined)."""
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise InvalidRequestError(
                f"message {i} must have string 'role' and 'content', got {short_repr(m)}"
            )
        if content is None and m.get("tool_calls"):
            content = ""
        elif isinstance(content, list):
            content = "\n".join(_text_part(i, j, part) for j, part in enumerate(content))
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"message {i} must have string 'role' and 'content', got {short_repr(m)}"
            )
        self._check_text(f"message {i} role", role)
        self._check_text(f"message {i} content", content)
        return {**m, "content": content}

    def _check_text(self, what: str, text: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"{what} is not valid Unicode text ({e.reason} at index {e.start})"
            ) from None
        self._check_length(len(text), what)

    def _check_length(self, num_chars: int, what: str) -> None:
        if num_chars > self.max_model_len * self.max_token_chars:
            raise PromptTooLongError(
                f"{what} has {num_chars} characters: more than max_model_len = {self.max_model_len} tokens "
                f"can hold (at most {self.max_token_chars} characters per token)"
            )

    def _encode(self, text: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception as e:  # the tokenizer rejects this text
            raise InvalidRequestError(f"prompt could not be tokenized: {type(e).__name__}: {e}") from None


def _text_part(i: int, j: int, part: object) -> str:
    """Content part ``j`` of message ``i``: only text parts are supported."""
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidRequestError(
            f"message {i} content part {j} is {short_repr(kind)}: only text parts are supported"
        )
    return part["text"]
