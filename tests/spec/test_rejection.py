"""Rejection sampling of one-hot drafts: the emitted tokens follow the target distribution
(chi-square on a five-token vocabulary, fixed seed), whatever the drafts; greedy rows accept
exactly the argmax."""

from __future__ import annotations

import torch

from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.spec.rejection import accept_sampled, target_probs

# chi-square critical value for 4 degrees of freedom at p = 0.001
CHI2_4DF_999 = 18.467


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


def sampled_positions_follow(
    logits: torch.Tensor,
    drafts: tuple[int, ...],
    params: SamplingParams,
    p: torch.Tensor,
    gen: torch.Generator,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept two drafts over 5 tokens ``n`` times; each position's emitted tokens (the first,
    the one after an accepted first draft, the bonus after both) must follow its row of ``p``
    (chi-square, 4 degrees of freedom, p = 0.001). The counts of each position."""
    first, second, third = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    for _ in range(n):
        toks = accept_sampled(logits, drafts, params, gen)
        assert 1 <= len(toks) <= 3 and list(toks[: len(toks) - 1]) == list(drafts[: len(toks) - 1])
        first[toks[0]] += 1
        if len(toks) >= 2:
            second[toks[1]] += 1
        if len(toks) == 3:
            third[toks[2]] += 1
    assert _chi2(first, p[0]) < CHI2_4DF_999
    assert _chi2(second, p[1]) < CHI2_4DF_999
    assert _chi2(third, p[2]) < CHI2_4DF_999
    return first, second, third


def test_emitted_tokens_follow_the_target_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, 0.3], [1.0, 1.0, 0.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.8, max_tokens=4)
    p = target_probs(logits, params)
    assert torch.allclose(p.sum(-1), torch.ones(3))
    gen = torch.Generator().manual_seed(1234)
    n = 20_000
    drafts = (1, 3)  # neither is the most likely token of its row
    first, _, _ = sampled_positions_follow(logits, drafts, params, p, gen, n)
    # acceptance of the first draft is p_0(d_1)
    assert abs(float(first[1]) / n - float(p[0, 1])) < 0.02


def test_top_k_and_top_p_shape_the_target() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2, max_tokens=1))
    assert (p[0, 2:] == 0).all() and p[0, 0] > p[0, 1] > 0
    gen = torch.Generator().manual_seed(0)
    # a draft outside the top-k is never accepted; the drawn token is one of the top two
    for _ in range(200):
        toks = accept_sampled(
            logits.repeat(2, 1), (4,), SamplingParams(temperature=1.0, top_k=2, max_tokens=1), gen
        )
        assert len(toks) == 1 and toks[0] in (0, 1)


def test_greedy_rows_accept_the_argmax_only() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    assert accept_sampled(logits, (1, 0), greedy, gen) == [1, 0, 2]
    assert accept_sampled(logits, (1, 2), greedy, gen) == [1, 0]
    assert accept_sampled(logits, (2, 0), greedy, gen) == [1]
