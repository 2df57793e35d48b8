"""Constrained decoding in the engine: constraints validated on construction, compiled once per
spec, masks applied to the constrained rows only, and constrained requests that finish with a
valid output under plain and async scheduling, with ``n`` children and through preemption."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

from deltaserve.engine import EngineCore, InvalidRequestError, RequestOutput, SamplingParams
from deltaserve.engine.constraint import SAFE_INTEGER, Constraint, ConstraintKind, bounded_schema
from deltaserve.engine.grammar import Grammars
from deltaserve.engine.runner.request_state import RequestState
from deltaserve.engine.runner.sampling import Sampler, apply_token_mask
from deltaserve.kernels import get_ops
from deltaserve.models.tokenizer import load_tokenizer
from tests.engine.conftest import run_to_completion

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(SCHEMA))


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer("builtin:tiny-qwen3.5")


def text_of(outs: list[Any]) -> str:
    """A core's request reply as text (a core emits token ids: decoded here)."""
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    return str(_tokenizer().decode([t for o in outs for t in o.token_ids], skip_special_tokens=True))


# ------------------------------------------------------------------ constraints
@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        (ConstraintKind.JSON_SCHEMA, "{not json", "the JSON schema is not valid JSON"),
        (ConstraintKind.JSON_SCHEMA, "[1, 2]", "the JSON schema must be a JSON object"),
        (
            ConstraintKind.JSON_SCHEMA,
            '{"type": "objectx"}',
            'invalid json_schema: Unsupported type "objectx"',
        ),
        (ConstraintKind.REGEX, "a(b", "invalid regex: Regex parsing error at position 4"),
        (ConstraintKind.REGEX, "", "a regex constraint needs a non-empty string"),
        (ConstraintKind.CHOICE, [], "a choice constraint needs a non-empty list of non-empty strings"),
        (ConstraintKind.CHOICE, ["a", ""], "a choice constraint needs a non-empty list of non-empty strings"),
        (ConstraintKind.GRAMMAR, 'root ::= "a" | ', "invalid grammar: EBNF parser error"),
        (ConstraintKind.JSON_OBJECT, "{}", "a json_object constraint takes no spec"),
    ],
)
def test_an_invalid_spec_is_a_typed_error_naming_the_field(
    kind: ConstraintKind, spec: Any, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        Constraint(kind=kind, spec=spec)
    assert str(e.value).startswith(f"SamplingParams.constraint.spec: {message}")


def test_sampling_params_take_only_a_constraint() -> None:
    with pytest.raises(
        InvalidRequestError, match=r"^SamplingParams.constraint=\{'type': 'object'\}: must be"
    ):
        SamplingParams(constraint={"type": "object"})  # type: ignore[arg-type]
    assert SamplingParams(constraint=JSON_SCHEMA).constraint is JSON_SCHEMA


def test_unbounded_integers_get_the_interoperable_range() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 3}},
    }
    out = json.loads(bounded_schema(json.dumps(schema)))
    assert out["properties"]["a"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert out["properties"]["b"] == {"type": "integer", "minimum": 3}


def test_a_length_bounded_string_never_holds_a_control_character(tiny_loaded: Any) -> None:
    """(xgrammar 0.2.8's own maxLength rule would allow one: invalid JSON.)"""
    grammars = Grammars(tiny_loaded.tokenizer, 1024, tiny_loaded.eos_token_ids)
    spec = json.dumps(
        {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
    )
    matcher = grammars.matcher(Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=spec))
    assert matcher.accept_string('{"s": "ab')
    mask = grammars.allocate(1)
    grammars.fill_masks([matcher], mask, [0])
    tok = tiny_loaded.tokenizer
    allowed = [t for t in range(len(tok)) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and not [t for t in allowed if any(ord(ch) < 32 for ch in tok.decode([t]))]


# ------------------------------------------------------------------ compile cache
def test_each_spec_is_compiled_once_and_the_cache_is_lru(tiny_loaded: Any) -> None:
    grammars = Grammars(tiny_loaded.tokenizer, 1024, tiny_loaded.eos_token_ids, cache_entries=2)
    a, b, c = (Constraint(kind=ConstraintKind.REGEX, spec=s) for s in ("a+", "b+", "c+"))
    first = grammars.compile(a)
    assert grammars.compile(Constraint(kind=ConstraintKind.REGEX, spec="a+")) is first
    grammars.compile(b)
    grammars.compile(a)  # a is now the most recent: c evicts b
    grammars.compile(c)
    assert grammars.compiles == 3
    assert grammars.compile(a) is first
    grammars.compile(b)
    assert grammars.compiles == 4


# ------------------------------------------------------------------ the mask in the sampler
def test_the_mask_allows_only_its_tokens_and_leaves_other_rows_alone() -> None:
    vocab, words = 100, 3  # the bitmask covers 96 ids: 96..99 are forbidden to masked rows
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    original = logits.clone()
    allowed = {0: [1, 33, 64, 95], 2: [7]}
    bitmask = torch.zeros(4, words, dtype=torch.int32)
    bitmask[1] = bitmask[3] = -1
    for row, ids in allowed.items():
        for t in ids:
            bitmask[row, t // 32] |= 1 << (t % 32)
    apply_token_mask(logits, bitmask, [0, 2])
    assert torch.equal(logits[1], original[1]) and torch.equal(logits[3], original[3])
    for row, ids in allowed.items():
        finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert finite == ids
        assert torch.equal(logits[row, ids], original[row, ids])
    sampler = Sampler(get_ops("reference"), torch.device("cpu"))
    params = [SamplingParams(temperature=1.0)] * 4
    states = [RequestState(stop_ids=frozenset(), generator=None) for _ in range(4)]
    seen: dict[int, set[int]] = {0: set(), 2: set()}
    for _ in range(200):
        tokens, _ = sampler.sample_rows(logits, [None] * 4, params, states, [[]] * 4)  # type: ignore[list-item]
        for row in seen:
            seen[row].add(int(tokens[row]))
    assert seen[0] <= set(allowed[0]) and len(seen[0]) > 1
    assert seen[2] == {7}


# ------------------------------------------------------------------ the engine
def _wave() -> list[tuple[str, Any, SamplingParams]]:
    choice = Constraint(kind=ConstraintKind.CHOICE, spec=["yes", "no", "maybe not"])
    regex = Constraint(kind=ConstraintKind.REGEX, spec=r"[A-Z][a-z]{2,6}-\d{3}")
    return [
        *((f"json{i}", "Describe a person:", SamplingParams(max_tokens=300, seed=i, constraint=JSON_SCHEMA)) for i in range(3)),
        ("obj", "JSON:", SamplingParams(max_tokens=300, seed=7, constraint=Constraint(kind=ConstraintKind.JSON_OBJECT))),
        ("choice", "Answer:", SamplingParams(max_tokens=20, seed=1, constraint=choice)),
        ("regex", "Code:", SamplingParams(max_tokens=20, seed=2, constraint=regex)),
        ("free", "Once upon a time", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
    ]  # fmt: skip


def _serve(core: EngineCore, wave: list[tuple[str, Any, SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for rid, prompt, params in wave:
        core.add_request(core.make_request(prompt, params, request_id=rid))
    outs = run_to_completion(core)
    core.close()
    assert core.num_constrained == 0
    return outs


def _check(outs: dict[str, list[RequestOutput]]) -> None:
    for rid in ("json0", "json1", "json2"):
        jsonschema.validate(json.loads(text_of(outs[rid])), SCHEMA)
        assert outs[rid][-1].finish_reason == "stop"
    assert isinstance(json.loads(text_of(outs["obj"])), dict)
    assert text_of(outs["choice"]) in ("yes", "no", "maybe not")
    assert re.fullmatch(r"[A-Z][a-z]{2,6}-\d{3}", text_of(outs["regex"]))
    assert outs["free"][-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs["free"]) == 24


def test_constrained_requests_finish_valid_under_plain_and_async_scheduling(
    core_factory: Callable[..., EngineCore],
) -> None:
    plain = _serve(core_factory(), _wave())
    _check(plain)
    overlapped = _serve(core_factory(**{"engine.async_scheduling": True}), _wave())
    _check(overlapped)
    for rid in plain:  # (the same seeds: the same tokens, the mask needing no overlap)
        assert [t for o in overlapped[rid] for t in o.token_ids] == [
            t for o in plain[rid] for t in o.token_ids
        ]


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(
    core_factory: Callable[..., EngineCore],
) -> None:
    alone = _serve(core_factory(**{"engine.async_scheduling": True}), _wave()[-1:])
    mixed = _serve(core_factory(**{"engine.async_scheduling": True}), _wave())
    assert [t for o in mixed["free"] for t in o.token_ids] == [t for o in alone["free"] for t in o.token_ids]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_preempted_request_resumes_its_matcher(
    core_factory: Callable[..., EngineCore], async_scheduling: bool
) -> None:
    """A KV pool too small for the batch: constrained requests are preempted and recomputed;
    their matchers keep their state, so outputs equal those of a roomy pool, and are valid."""
    schema = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(SCHEMA))
    wave = [
        (f"p{i}", [3 + (i * 7 + k) % 900 for k in range(40 + 5 * i)], SamplingParams(max_tokens=120, seed=i, constraint=schema))
        for i in range(6)
    ]  # fmt: skip
    config = {"engine.async_scheduling": async_scheduling}
    roomy = _serve(core_factory(**config), wave)
    tight_core = core_factory(**config, **{"cache.num_kv_blocks": 24})
    tight = _serve(tight_core, wave)
    assert tight_core.stats()["scheduler.preemptions"] > 0
    for rid in roomy:
        assert text_of(tight[rid]) == text_of(roomy[rid]), rid
        if tight[rid][-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text_of(tight[rid])), SCHEMA)


def test_ids_past_the_tokenizer_are_never_allowed(tiny_loaded: Any) -> None:
    """A model vocabulary padded past the tokenizer's (the Qwen3.5-shaped model): a constrained
    row can never sample a padding id."""
    tokenizer_size, model_vocab = len(tiny_loaded.tokenizer), 2048 + 7
    grammars = Grammars(tiny_loaded.tokenizer, model_vocab, tiny_loaded.eos_token_ids)
    matcher = grammars.matcher(Constraint(kind=ConstraintKind.JSON_OBJECT))
    mask = grammars.allocate(2)
    grammars.fill_masks([matcher], mask, [1])
    logits = torch.zeros(2, model_vocab)
    apply_token_mask(logits, mask, [1])
    assert torch.isfinite(logits[1, :tokenizer_size]).any()
    assert not torch.isfinite(logits[1, tokenizer_size:]).any()
    assert torch.isfinite(logits[0]).all()
