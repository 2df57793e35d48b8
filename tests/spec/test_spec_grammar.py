"""Speculative decoding with output constraints: a draft the grammar cannot take ends the
accepted run, never the request; each verified row is masked as a decode at that position
would be; greedy constrained outputs are identical to speculation off, sampled ones valid."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.spec.replay import ReplayDrafter
from tests.engine.test_grammar import _check, _serve, _wave
from tests.spec.test_spec_greedy import _spec


def _greedy_wave() -> list[tuple[str, Any, SamplingParams]]:
    """The grammar tests' wave, greedy (temperature 0, so outputs are comparable token for token)."""
    out = []
    for rid, prompt, p in _wave():
        params = SamplingParams(max_tokens=p.max_tokens, temperature=0.0, constraint=p.constraint,
                                ignore_eos=p.ignore_eos)  # fmt: skip
        out.append((rid, prompt, params))
    return out


def _tokens(outs: dict[str, list[Any]]) -> dict[str, list[int]]:
    return {rid: [t for o in os for t in o.token_ids] for rid, os in outs.items()}


def _seed_replay(core: EngineCore, recorded: dict[str, list[int]], wrong: bool = False) -> None:
    drafter = core.speculation.drafter  # type: ignore[union-attr]
    assert isinstance(drafter, ReplayDrafter)
    for rid, prompt, params in _greedy_wave():
        drafter.record(core.make_request(prompt, params).prompt_token_ids, recorded[rid])
    if wrong:  # every draft after the first is token 0, which no constrained reply here continues with
        propose = drafter.propose
        drafter.propose = lambda req, k: [t if i == 0 else 0 for i, t in enumerate(propose(req, k))]  # type: ignore[method-assign]


def test_greedy_constrained_outputs_equal_speculation_off(core_factory: Callable[..., EngineCore]) -> None:
    off = _serve(core_factory(), _greedy_wave())
    _check(off)
    for corrupt, wrong in ((0, False), (2, False), (0, True)):
        core = core_factory(**{"speculative.method": "replay", "speculative.replay_corrupt_every": corrupt})
        _seed_replay(core, _tokens(off), wrong)
        on = _serve(core, _greedy_wave())
        _check(on)  # every request finished valid: no draft failed one
        assert _tokens(on) == _tokens(off), (corrupt, wrong)
        s = _spec(core)
        assert s["spec_decode.num_accepted_tokens"] > 0
        if not corrupt and not wrong:
            assert s["spec_decode.acceptance_rate"] == 1.0


def test_sampled_constrained_requests_with_ngram_drafts_stay_valid(
    core_factory: Callable[..., EngineCore],
) -> None:
    core = core_factory(**{"speculative.method": "ngram", "speculative.prompt_lookup_min": 1})
    outs = _serve(core, _wave())
    _check(outs)
    assert _spec(core)["spec_decode.num_draft_tokens"] > 0


def test_greedy_constrained_outputs_equal_under_async_scheduling(
    core_factory: Callable[..., EngineCore],
) -> None:
    """Constrained requests with drafts in the overlapped loop: the same outputs as the plain
    loop without speculation (every verify row masked with its matcher advanced by real tokens)."""
    off = _serve(core_factory(), _greedy_wave())
    core = core_factory(**{
        "engine.async_scheduling": True, "speculative.method": "replay", "speculative.replay_corrupt_every": 2,
    })  # fmt: skip
    _seed_replay(core, _tokens(off))
    on = _serve(core, _greedy_wave())
    _check(on)
    assert _tokens(on) == _tokens(off)
    assert _spec(core)["spec_decode.num_accepted_tokens"] > 0
    core.close()
