"""SamplingParams: every bad value is a typed error naming its field; every accepted value is
safe all the way through the sampler."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
import torch

from deltaserve.engine import InvalidRequestError, SamplingParams
from deltaserve.engine import sampling_params as sp
from deltaserve.kernels import sampler

NAN, INF = float("nan"), float("inf")

BAD: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2**31),
    ("max_tokens", 10**5000),  # too big even to repr
    ("max_tokens", True),
    ("max_tokens", 16.0),
    ("max_tokens", "16"),
    ("temperature", -0.1),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", -INF),
    ("temperature", 10**400),  # an int too large for a float
    ("temperature", True),
    ("temperature", "0.7"),
    ("temperature", None),
    ("top_k", 2**63),
    ("top_k", 2**31),
    ("top_k", -2),
    ("top_k", 10**400),
    ("top_k", 5.0),
    ("top_k", False),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.5),
    ("top_p", NAN),
    ("top_p", INF),
    ("top_p", True),
    ("seed", -3),
    ("seed", 2**64),
    ("seed", 10**400),
    ("seed", 1.0),
    ("seed", True),
    ("stop", [""]),
    ("stop", "stop"),
    ("stop", [b"x"]),
    ("stop", [None]),
    ("stop", ["x"] * 17),
    ("stop", ["x" * 257]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**31]),
    ("stop_token_ids", [2**63]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 5),
    ("stop_token_ids", list(range(1025))),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > max_tokens (16)
    ("min_tokens", True),
    ("min_tokens", 2.0),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_value_is_typed_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert type(info.value) is InvalidRequestError
    message = str(info.value)
    assert message.startswith(f"SamplingParams.{field}="), message
    assert len(message) < 200, message  # bounded, whatever the value


def test_messages_are_specific() -> None:
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "top_k": (
            {"top_k": 2**63},
            "SamplingParams.top_k=9223372036854775808: must be an integer >= -1 and < 2**31",
        ),
        "seed": (
            {"seed": 2**64},
            "SamplingParams.seed=18446744073709551616: must be a non-negative integer or None",
        ),
        "temperature": ({"temperature": NAN}, "SamplingParams.temperature=nan: must be a finite number >= 0"),
        "max_tokens": ({"max_tokens": 10**5000}, "SamplingParams.max_tokens=<int of 16610 bits>: must be"),
        "stop count": (
            {"stop": ["x"] * 17},
            "SamplingParams.stop=<list of 17 items>: must hold at most 16 strings",
        ),
        "stop length": ({"stop": ["x" * 257]}, "each stop string must be at most 256 characters"),
        "stop ids": ({"stop_token_ids": list(range(1025))}, "must hold at most 1024 ids, got 1025"),
        "min_tokens": (
            {"max_tokens": 4, "min_tokens": 5},
            "SamplingParams.min_tokens=5: must be an integer in",
        ),
    }
    for kwargs, message in cases.values():
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            SamplingParams(**kwargs)


GOOD: list[dict[str, Any]] = [
    {"max_tokens": 2**31 - 1},
    {"temperature": 0},
    {"temperature": 1e-38},  # below GREEDY_TEMPERATURE: decodes greedily
    {"temperature": 5e-324},
    {"temperature": 1e-5},
    {"temperature": 1e300},
    {"top_k": -1},
    {"top_k": 2**31 - 1},  # beyond any vocabulary: off
    {"top_p": 1e-12},
    {"seed": 0},
    {"seed": 2**64 - 1},
    {"stop": ["x" * 256] * 16},
    {"stop_token_ids": list(range(1024))},
    {"max_tokens": 5, "min_tokens": 5},
]


@pytest.mark.parametrize("kwargs", GOOD, ids=lambda kw: ",".join(kw))
def test_accepted_extremes_run_through_the_sampler(kwargs: dict[str, Any]) -> None:
    """What the engine does with accepted values (model_runner's tensors, the request's
    generator, the sampler) never raises and never yields a token outside the vocabulary."""
    p = SamplingParams(**kwargs)
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 20
    logits[1, 10:] = float("-inf")
    gen = None
    if p.seed is not None:
        gen = torch.Generator()
        gen.manual_seed(p.seed)
    tokens = sampler.sample(
        logits,
        torch.tensor([p.temperature] * 2, dtype=torch.float32),
        torch.tensor([p.top_k] * 2, dtype=torch.int64),
        torch.tensor([p.top_p] * 2, dtype=torch.float32),
        [gen, None],
    )
    assert ((tokens >= 0) & (tokens < 50)).all() and tokens[1] < 10
    if 0 <= p.temperature < sp.GREEDY_TEMPERATURE:
        assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_threshold_is_one_constant() -> None:
    assert sp.GREEDY_TEMPERATURE == sampler.GREEDY_TEMPERATURE


def test_decoded_params_are_validated_too() -> None:
    assert msgspec.convert({"top_k": 3}, SamplingParams).top_k == 3
    # msgspec reports a __post_init__ ValueError as its own ValidationError, same message
    with pytest.raises(msgspec.ValidationError, match=r"SamplingParams.top_k=1099511627776: must be"):
        msgspec.convert({"top_k": 2**40}, SamplingParams)


def test_docstring_documents_every_field() -> None:
    doc = SamplingParams.__doc__ or ""
    assert "msgspec" not in doc.splitlines()[0]
    for field in SamplingParams.__struct_fields__:
        assert re.search(rf"^    {field} \(", doc, re.M), field
    with pytest.raises(TypeError):  # still keyword-only
        SamplingParams(16)  # type: ignore[misc]
    with pytest.raises(AttributeError):  # still frozen
        SamplingParams().top_k = 3  # type: ignore[misc]
