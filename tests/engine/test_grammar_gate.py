"""The gated matcher: a constraint that starts after the reasoning's end marker. Free text (no
stop token, no token past the marker) until the marker, the grammar's own masks after it, and
the matcher operations speculative decoding uses (accept over drafts, rollback across the
marker, fork, reset) exact."""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec
import pytest
import torch

from deltaserve.engine import InvalidRequestError, SamplingParams
from deltaserve.engine.constraint import Constraint, ConstraintKind, trusted_decode
from deltaserve.engine.grammar import Grammars
from deltaserve.engine.grammar_gate import GatedMatcher, GateTables, partial_match
from tests.engine.test_grammar import _tokenizer

END = "</think>"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
GATED = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(SCHEMA), starts_after=END)
PLAIN = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(SCHEMA))
VOCAB = 1024


@functools.cache
def _grammars() -> Grammars:
    eos = _tokenizer().convert_tokens_to_ids("<|im_end|>")
    return Grammars(_tokenizer(), VOCAB, [eos])


def _ids(text: str) -> list[int]:
    return list(_tokenizer().encode(text, add_special_tokens=False))


def _mask(matcher: Any) -> torch.Tensor:
    g = _grammars()
    mask = g.allocate(1)
    g.fill_masks([matcher], mask, [0])
    return mask[0]


def _allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _gated() -> GatedMatcher:
    g = _grammars()
    m = g.matcher_of(g.compile(GATED), GATED.starts_after)
    assert isinstance(m, GatedMatcher)
    return m


def test_the_marker_matches_across_token_boundaries() -> None:
    m = b"</think>"
    assert partial_match(m, 0, b"x</th") == (4, 0)
    assert partial_match(m, 4, b"ink>") == (8, 0)
    assert partial_match(m, 4, b"ink>\n\n") == (8, 2)  # 2 bytes past the marker
    assert partial_match(m, 1, b"<") == (1, 0)  # "<<": still one byte matched
    assert partial_match(m, 0, b"think") == (0, 0)


def test_the_free_phase_allows_all_but_stop_tokens_and_overshooting_ones() -> None:
    # a toy vocabulary: "a", "</", "think", ">", ">\n" (overshoots from 7 bytes matched), EOS,
    # and a padding id (no bytes)
    decoded = [b"a", b"</", b"think", b">", b">\n", b"<|eos|>", b"x</think>y", b"</think>", b""]
    t = GateTables(END, decoded, 64, [5])

    def ok(matched: int) -> list[int]:
        return [i for i in range(len(decoded)) if (int(t.masks[matched][i // 32]) >> (i % 32)) & 1]

    assert ok(0) == [0, 1, 2, 3, 4, 7]  # no stop token, no "x</think>y"; ids past the vocabulary: none
    assert ok(7) == [0, 1, 2, 3, 7]  # after "</think": ">\n" would go past the marker
    assert t.masks.shape == (len(END), 2)
    m = GatedMatcher(None, t)
    assert not m.accept_token(8) and not m.accept_token(5) and not m.accept_token(40)  # padding, EOS, past
    assert m.accept_token(1) and m.accept_token(2) and not m.accept_token(4) and m.accept_token(3)
    assert m.in_grammar and m.num_free_tokens == 3
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        GateTables("", decoded, 64, [5])


def test_a_marker_is_validated_with_the_constraint() -> None:
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams.constraint.starts_after='': must be"):
        Constraint(kind=ConstraintKind.JSON_OBJECT, starts_after="")
    with pytest.raises(InvalidRequestError, match="1 to 64 bytes"):
        Constraint(kind=ConstraintKind.JSON_OBJECT, starts_after="x" * 65)
    assert GATED.key == PLAIN.key  # one compiled grammar for both


def test_masks_before_the_marker_are_free_and_after_it_the_grammars() -> None:
    g = _grammars()
    eos = _tokenizer().convert_tokens_to_ids("<|im_end|>")
    m = _gated()
    plain = g.matcher_of(g.compile(PLAIN))
    free = _mask(m)
    assert not _allowed(free, eos) and not m.accept_token(eos)  # the request may not end while it reasons
    assert all(_allowed(free, t) for t in range(len(_tokenizer())) if t != eos)
    # the plain grammar forbids what the free phase allows (free text before the JSON)
    assert not _allowed(_mask(plain), _ids("Hmm")[0])
    for t in _ids("Hmm, Paris.</think>"):
        assert _allowed(_mask(m), t) and not m.in_grammar
        assert m.accept_token(t)
    assert m.in_grammar and m.num_free_tokens == len(_ids("Hmm, Paris.</think>"))
    for t in _ids('{"city": "Par'):
        assert torch.equal(_mask(m), _mask(plain))
        assert m.accept_token(t) and plain.accept_token(t)
    assert torch.equal(_mask(m), _mask(plain))
    assert not m.accept_token(eos)  # the grammar is not complete: EOS is still not allowed


def test_rollback_across_the_marker_reopens_the_free_phase_exactly() -> None:
    text = _ids("ok.</think>")
    answer = _ids('{"city": "A", "days": 3}')
    m = _gated()
    masks = []
    for t in [*text, *answer]:
        masks.append(_mask(m))
        assert m.accept_token(t)
    eos = _tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert m.is_completed() and not m.is_terminated()
    assert m.accept_token(eos) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated()
    # back over the whole answer and the marker's last two tokens, in two rollbacks
    m.rollback(len(answer))
    assert m.in_grammar and torch.equal(_mask(m), masks[len(text)])
    m.rollback(2)
    assert not m.in_grammar and m.matched == len("</thin") and torch.equal(_mask(m), masks[len(text) - 2])
    assert m.find_jump_forward_string() == "" and not m.is_completed()
    for j, t in enumerate([*text[-2:], *answer]):  # forward again: the same masks
        assert torch.equal(_mask(m), masks[len(text) - 2 + j])
        assert m.accept_token(t)
    assert m.is_completed()
    with pytest.raises(ValueError, match=r"rollback\(99\): \d+ tokens were accepted"):
        m.rollback(99)
    m.rollback(len(text) + len(answer))
    assert (m.in_grammar, m.matched, m.num_free_tokens) == (False, 0, 0)
    assert torch.equal(_mask(m), masks[0])


def test_fork_is_independent_and_reset_starts_over() -> None:
    m = _gated()
    for t in _ids("x</think>{"):
        assert m.accept_token(t)
    twin = m.fork()
    assert twin.in_grammar and torch.equal(_mask(twin), _mask(m))
    twin.rollback(2)  # "{" and ">"
    assert not twin.in_grammar and m.in_grammar
    assert m.accept_token(_ids('"')[0]) and twin.accept_token(_ids(">")[0])
    assert twin.in_grammar and not torch.equal(_mask(twin), _mask(m))
    m.reset()
    assert (m.in_grammar, m.num_free_tokens) == (False, 0)
    assert torch.equal(_mask(m), _mask(_gated()))


def test_a_batch_of_plain_and_gated_matchers_fills_each_row_as_alone() -> None:
    g = _grammars()
    plain = g.matcher_of(g.compile(PLAIN))
    free, answering = _gated(), _gated()
    for t in _ids("so</think>{"):
        assert answering.accept_token(t)
    for t in _ids("so</th"):
        assert free.accept_token(t)
    matchers = [plain, free, answering]
    batch = g.allocate(5)
    g.fill_masks(matchers, batch, [4, 0, 2])
    for m, row in zip(matchers, [4, 0, 2], strict=True):
        assert torch.equal(batch[row], _mask(m))
    assert torch.equal(batch[1], g.allocate(1)[0]) and torch.equal(batch[3], g.allocate(1)[0])


def test_the_marker_crosses_to_a_core_process_with_its_request() -> None:
    params = SamplingParams(max_tokens=8, constraint=GATED)
    wire = msgspec.msgpack.encode(params)
    with trusted_decode():
        back = msgspec.msgpack.decode(wire, type=SamplingParams)
    assert back.constraint == GATED and back.constraint.starts_after == END
