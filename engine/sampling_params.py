"""SamplingParams: how one request is decoded. Validated on creation, then immutable.

One object flows by reference from ``generate`` to the sampler and the stop checker.
Every field is range-checked here, so a value that passes can neither fail a step (and
with it the other requests in the batch) nor make the sampler produce NaN.

The fields the model may give defaults for (``MODEL_DEFAULT_FIELDS``: temperature, top_p,
top_k, min_p, repetition_penalty) hold, when the caller leaves them unset, marker values equal
to the neutral default (``1.0``, ``0`` ...) but told apart by identity: ``with_defaults``
(called by ``InputProcessor``, the front door of every placement) fills exactly those from the
model's ``generation_config.json``, so an explicit value, ``temperature=0`` or ``1.0`` included,
always wins. The markers are never encoded (``omit_defaults``: a decoded struct gets them
back) and pickle to themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from deltaserve.engine.constraint import Constraint, is_trusted, trusted_decode
from deltaserve.engine.errors import InvalidRequestError

MAX_TOKENS_LIMIT = 2**31 - 1  # max_tokens and top_k stay below 2**31 (int32 anywhere downstream)
TOP_K_LIMIT = 2**31 - 1
SEED_LIMIT = 2**64 - 1  # torch.Generator.manual_seed takes [0, 2**64) as its seed space
GREEDY_TEMPERATURE = 1e-5  # a temperature below this decodes greedily (kernels/sampler.py)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
TOKEN_ID_LIMIT = 2**31 - 1
MAX_N = 128  # OpenAI's bound on `n`
MAX_LOGPROBS = 20  # OpenAI's bound on `top_logprobs` (vLLM's default max_logprobs)
PENALTY_LIMIT = 2.0  # presence / frequency penalties live in [-2, 2] (OpenAI)


class _UnsetFloat(float):
    """A float field left unset: its neutral value, recognised by identity (module docstring)."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _unset, (_unset_name(self),)


class _UnsetInt(int):
    """An int field left unset: its neutral value, recognised by identity (module docstring)."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _unset, (_unset_name(self),)


#: the fields a model's generation_config.json may give defaults for, and their unset markers
_UNSET: dict[str, float | int] = {
    "temperature": _UnsetFloat(1.0),
    "top_k": _UnsetInt(0),
    "top_p": _UnsetFloat(1.0),
    "min_p": _UnsetFloat(0.0),
    "repetition_penalty": _UnsetFloat(1.0),
}
MODEL_DEFAULT_FIELDS = tuple(_UNSET)


def _unset(name: str) -> float | int:
    return _UNSET[name]


def _unset_name(marker: object) -> str:
    return next(name for name, m in _UNSET.items() if m is marker)


class SamplingParams(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """How one request is decoded: keyword-only, validated on creation, then immutable.

    A value out of range raises ``InvalidRequestError`` naming the field and the value
    (``SamplingParams.top_k=-5: ...``); nothing is clamped silently.

    Fields (default, accepted range):

    max_tokens (16; 1 <= max_tokens < 2**31)
        The most tokens to generate. The engine also stops at ``max_model_len``; a
        request whose prompt plus ``max_tokens`` can never fit the KV pool is rejected
        at ``generate``.
    temperature (1.0; a finite number >= 0)
        Divides the logits before sampling. ``0`` decodes greedily (argmax); so does any
        value below ``1e-5`` (``GREEDY_TEMPERATURE``): that is the limit of sampling as
        the temperature goes to 0, and dividing by a tinier value overflows float32.
        Large values flatten the distribution towards uniform.
    top_k (0; -1 <= top_k < 2**31)
        Keep only the ``top_k`` most likely tokens (ties broken by lower token id).
        ``0`` or ``-1`` turns it off, and so does any value >= the vocabulary size.
    top_p (1.0; 0 < top_p <= 1)
        Nucleus sampling: keep the shortest set of most likely tokens whose probability
        reaches ``top_p`` (always at least the most likely one). ``1`` turns it off.
    seed (None; None or 0 <= seed < 2**64)
        Seeds a generator of this request's own, so its tokens are reproducible whatever
        else is in the batch. ``None`` draws from the engine's shared generator. The
        range is the generator's whole seed space: two different accepted seeds never
        alias.
    stop ([]; at most 16 non-empty strings of at most 256 characters each)
        Generation stops when the output text contains one of them; the stop string and
        anything after it are not returned.
    stop_token_ids ([]; at most 1024 ids, each 0 <= id < 2**31)
        Generation stops after sampling one of these token ids (the engine also checks
        each id against the model's vocabulary at ``generate``).
    ignore_eos (False; a bool)
        Keep generating past the model's end-of-sequence tokens.
    min_tokens (0; 0 <= min_tokens <= max_tokens)
        Stop conditions (EOS, stop strings, stop token ids) are ignored until this many
        tokens have been generated.
    n (1; 1 <= n <= 128)
        Independent completions of the same prompt. The prompt is prefilled once: the
        first completion runs alone until its prompt is in the prefix cache, then the
        others start from the cache. With a ``seed``, completion ``i`` uses ``seed + i``
        (mod 2**64). Outputs carry ``RequestOutput.index``.
    logprobs (None; None or 0 <= logprobs <= 20)
        Return the log-probability of each generated token, plus that many most likely
        alternatives (``0``: the chosen token only), in ``RequestOutput.logprobs``. These
        are the model's raw log-probabilities (log-softmax of its logits before penalties,
        temperature, top-k/top-p/min-p: vLLM's default), whatever the sampling settings.
    presence_penalty (0.0; -2 <= presence_penalty <= 2)
        Subtracted from the logit of every token that already occurs in the output.
    frequency_penalty (0.0; -2 <= frequency_penalty <= 2)
        Subtracted from a token's logit once per occurrence in the output.
    repetition_penalty (1.0; a finite number > 0)
        For every token in the prompt or the output: a positive logit is divided by it, a
        negative one multiplied (``> 1`` discourages repeats; ``1`` turns it off).
    min_p (0.0; 0 <= min_p <= 1)
        After the temperature, drop tokens whose probability is below ``min_p`` times the
        most likely token's (``0`` turns it off). Greedy decoding ignores it.
    prompt_logprobs (None; None or 0 <= prompt_logprobs <= 20)
        Return, for every prompt token after the first, its log-probability given the tokens
        before it, plus that many most likely alternatives, in the request's first
        ``RequestOutput.prompt_logprobs`` (the first position is None: nothing predicts it).
        Raw model log-probabilities, like ``logprobs``. Such a request computes its whole
        prompt: it takes no prefix-cache hit (what it computes is still published).
    constraint (None; None or a ``Constraint``)
        The output must match it (a JSON schema, any JSON object, a regex, one of a list of
        strings, a grammar: ``engine/constraint.py``): tokens it does not allow are masked
        before sampling, and the request stops (``stop``) when the constraint is complete.
        The constraint validates its spec when it is built.

    Integers must be ``int`` (``bool`` is not accepted as an integer, nor as a number);
    floats must be finite. temperature, top_k, top_p, min_p and repetition_penalty left unset
    take the model's defaults (``generation_config.json``, ``model.generation_config``) when
    the engine takes the request; the defaults above are the values without one.
    """

    max_tokens: int = 16
    temperature: float = _UNSET["temperature"]
    top_k: int = _UNSET["top_k"]
    top_p: float = _UNSET["top_p"]
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = _UNSET["repetition_penalty"]
    min_p: float = _UNSET["min_p"]
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if is_trusted():  # decoded from a front end that validated it (``trusted_decode``)
            return
        for name, ok, why in _RULES:
            value = getattr(self, name)
            if not ok(value, self):
                message = why if isinstance(why, str) else why(value)
                raise InvalidRequestError(f"SamplingParams.{name}={_short_repr(value)}: {message}")

    def is_unset(self, name: str) -> bool:
        """Whether ``name`` (one of ``MODEL_DEFAULT_FIELDS``) was left unset by the caller."""
        return getattr(self, name) is _UNSET[name]

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These parameters with every field left unset that ``defaults`` names taken from it
        (the model's defaults: ``engine/model_files.sampling_defaults``); set fields are kept."""
        changes = {k: v for k, v in defaults.items() if self.is_unset(k)}
        if not changes:
            return self
        with trusted_decode():  # both sides are validated (the defaults when they were read)
            return msgspec.structs.replace(self, **changes)

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must apply repetition / frequency / presence penalties."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _penalty_ok(value: Any, _: SamplingParams) -> bool:
    return _finite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT


# The checks ``SamplingParams.__post_init__`` runs, in order: (field, test of the field's value
# given the whole object, what the error says). The first failing rule raises; the rules of one
# field run in order, so a later one may assume the earlier ones passed (``stop`` is a list).
_Rule = tuple[str, Callable[[Any, "SamplingParams"], bool], "str | Callable[[Any], str]"]
_RULES: tuple[_Rule, ...] = (
    ("max_tokens", lambda v, _: _int_in(v, 1, MAX_TOKENS_LIMIT), "must be an integer >= 1 and < 2**31"),
    ("temperature", lambda v, _: _finite(v) and v >= 0, "must be a finite number >= 0 (0: greedy)"),
    (
        "top_k",
        lambda v, _: _int_in(v, -1, TOP_K_LIMIT),
        "must be an integer >= -1 and < 2**31 (-1 or 0: off)",
    ),
    ("top_p", lambda v, _: _finite(v) and 0.0 < v <= 1.0, "must be in (0, 1]"),
    (
        "seed",
        lambda v, _: v is None or _int_in(v, 0, SEED_LIMIT),
        "must be a non-negative integer or None, below 2**64",
    ),
    (
        "stop",
        lambda v, _: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
        "must be a list of non-empty strings",
    ),
    (
        "stop",
        lambda v, _: len(v) <= MAX_STOP_STRINGS,
        lambda v: f"must hold at most {MAX_STOP_STRINGS} strings, got {len(v)}",
    ),
    (
        "stop",
        lambda v, _: all(len(s) <= MAX_STOP_STRING_CHARS for s in v),
        f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters",
    ),
    (
        "stop_token_ids",
        lambda v, _: isinstance(v, list) and all(_int_in(t, 0, TOKEN_ID_LIMIT) for t in v),
        "must be a list of non-negative token ids below 2**31",
    ),
    (
        "stop_token_ids",
        lambda v, _: len(v) <= MAX_STOP_TOKEN_IDS,
        lambda v: f"must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(v)}",
    ),
    ("ignore_eos", lambda v, _: isinstance(v, bool), "must be a bool"),
    ("min_tokens", lambda v, p: _int_in(v, 0, p.max_tokens), "must be an integer in [0, max_tokens]"),
    ("n", lambda v, _: _int_in(v, 1, MAX_N), f"must be an integer in [1, {MAX_N}]"),
    (
        "logprobs",
        lambda v, _: v is None or _int_in(v, 0, MAX_LOGPROBS),
        f"must be None or an integer in [0, {MAX_LOGPROBS}]",
    ),
    ("presence_penalty", _penalty_ok, "must be a number in [-2, 2] (0: off)"),
    ("frequency_penalty", _penalty_ok, "must be a number in [-2, 2] (0: off)"),
    (
        "repetition_penalty",
        lambda v, _: _finite(v) and v > 0,
        "must be a finite number > 0 (1: off)",
    ),
    ("min_p", lambda v, _: _finite(v) and 0.0 <= v <= 1.0, "must be in [0, 1] (0: off)"),
    (
        "prompt_logprobs",
        lambda v, _: v is None or _int_in(v, 0, MAX_LOGPROBS),
        f"must be None or an integer in [0, {MAX_LOGPROBS}]",
    ),
    ("constraint", lambda v, _: v is None or isinstance(v, Constraint), "must be None or a Constraint"),
)


def _int_in(value: Any, lo: int, hi: int) -> bool:
    """``value`` is an ``int`` (not a ``bool``) with ``lo <= value <= hi``."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _finite(value: Any) -> bool:
    """``value`` is a finite real number (``int`` or ``float``, not ``bool``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _short_repr(value: Any, limit: int = 80) -> str:
    """A bounded repr for error messages (a 5,000-digit int cannot even be repr'd)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<{'-' if value < 0 else ''}int of {value.bit_length()} bits>"
    if isinstance(value, list) and len(value) > 8:
        return f"<list of {len(value)} items>"
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
