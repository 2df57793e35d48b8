"""Speculative decoding with repetition / frequency / presence penalties: a penalised request
drafts, and each verify row counts the output as it stands at that row (the drafts before it
included). Greedy outputs equal speculation off for every penalty kind (sync and async
scheduling); sampled rows follow the distribution a decode at that position draws from
(chi-square, fixed seed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltaserve.engine import SamplingParams
from deltaserve.engine.runner.verify import penalised_rows
from deltaserve.engine.spec.rejection import target_probs
from tests.engine.conftest import greedy
from tests.spec.test_rejection import sampled_positions_follow
from tests.spec.test_spec_greedy import MAX_TOKENS, _prompts, _replay, _serve, _spec

PENALTIES = [
    {"repetition_penalty": 1.6},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.5},
]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: next(iter(p)))
@pytest.mark.parametrize("corrupt", [0, 2])
def test_greedy_with_penalties_equals_speculation_off(
    core_factory: Any, penalty: dict[str, float], corrupt: int
) -> None:
    prompts = _prompts(30, n=3)
    params = greedy(MAX_TOKENS, **penalty)
    off = _serve(core_factory(), prompts, params)
    assert off != _serve(core_factory(), prompts, greedy(MAX_TOKENS))  # the penalty changes outputs
    core = core_factory(**{"speculative.method": "replay", "speculative.replay_corrupt_every": corrupt})
    _replay(core, prompts, off)
    assert _serve(core, prompts, params) == off
    s = _spec(core)
    assert s["spec_decode.num_drafts"] > 0  # (a penalised request never drafted before)
    if corrupt:
        assert s["spec_decode.num_accepted_tokens_per_pos.1"] == 0
    else:
        assert s["spec_decode.acceptance_rate"] == 1.0


def test_greedy_with_penalties_under_async_scheduling(core_factory: Any) -> None:
    prompts = _prompts(31, n=3)
    params = greedy(MAX_TOKENS, frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.2)
    off = _serve(core_factory(), prompts, params)
    core = core_factory(**{
        "engine.async_scheduling": True, "speculative.method": "replay", "speculative.replay_corrupt_every": 3,
    })  # fmt: skip
    _replay(core, prompts, off)
    assert _serve(core, prompts, params) == off
    assert _spec(core)["spec_decode.num_accepted_tokens"] > 0
    core.close()


def test_rows_count_the_drafts_before_them(core_factory: Any, monkeypatch: Any) -> None:
    """The identity above rests on each row counting the drafts before it: penalising every
    row with the output before the window only accepts drafts a decode would not emit."""
    import deltaserve.engine.runner.verify as verify

    # (the tiny model seldom repeats a token within a window: this prompt set and penalty are
    # one where it does; the per-row counts of every kind are checked directly below)
    prompts = _prompts(31, n=3)
    params = greedy(MAX_TOKENS, repetition_penalty=1.6)
    off = _serve(core_factory(), prompts, params)
    drafts = off  # every window the penalised output: a blind row may prefer a token drafted before it
    real = verify.penalised_rows

    def window_blind(rows: Any, drafts: Any, p: Any, output: Any, prompt: Any) -> Any:
        return real(rows, (), p, output, prompt)

    core = core_factory(**{"speculative.method": "replay"})
    _replay(core, prompts, drafts)
    monkeypatch.setattr(verify, "penalised_rows", window_blind)
    assert _serve(core, prompts, params) != off
    monkeypatch.setattr(verify, "penalised_rows", real)
    core = core_factory(**{"speculative.method": "replay"})
    _replay(core, prompts, drafts)
    assert _serve(core, prompts, params) == off


def _decode_penalised(row: torch.Tensor, output: list[int], params: SamplingParams) -> torch.Tensor:
    """A reference written out: vLLM's order, repetition over prompt and output, then
    frequency and presence over the output (the prompt here is empty)."""
    out = row.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=row.shape[0]).float()
    seen = counts > 0
    r = params.repetition_penalty
    out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    return out - params.frequency_penalty * counts - params.presence_penalty * seen.float()


def test_sampled_rows_follow_the_penalised_distribution_at_each_position() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, 0.3], [1.0, 1.0, 0.0, 2.0, 0.0]])
    params = SamplingParams(
        temperature=0.9, max_tokens=4, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3
    )
    output = [0, 3, 0]  # the request's output so far (its last token included)
    drafts = (1, 3)
    rows = penalised_rows(logits, drafts, params, output, [])
    # row j is the decode after output + drafts[:j]: the drafts before it counted
    for j in range(3):
        want = _decode_penalised(logits[j], output + list(drafts[:j]), params)
        assert torch.allclose(rows[j], want, atol=1e-6), j
    p = target_probs(rows, params)
    gen = torch.Generator().manual_seed(4321)
    n = 20_000
    sampled_positions_follow(rows, drafts, params, p, gen, n)


def test_seeded_sampling_with_penalties_drafts_and_reproduces(core_factory: Any) -> None:
    prompts = _prompts(33, n=3)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    params = SamplingParams(
        temperature=0.6,
        seed=5,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        frequency_penalty=0.3,
        presence_penalty=0.2,
    )
    runs = []
    for _ in range(2):
        core = core_factory(**{"speculative.method": "replay"})
        _replay(core, prompts, off)
        runs.append(_serve(core, prompts, params))
        s = _spec(core)
        assert s["spec_decode.num_draft_tokens"] > 0 and s["spec_decode.num_accepted_tokens"] > 0
    assert runs[0] == runs[1]
    assert all(len(t) == MAX_TOKENS for t in runs[0].values())
