"""Acceptance of sampled drafts: rejection sampling for deterministic proposals.

A drafter proposes one token per position (a one-hot proposal ``q``). For window position
``j`` with target distribution ``p_j`` (the request's temperature, top-k, top-p and min-p
applied to row ``j``'s logits: ``target_probs``), the draft ``d`` is accepted with probability
``min(1, p_j(d) / q(d)) = p_j(d)``; on rejection the token is drawn from the residual
``max(0, p_j - q)``, normalised — ``p_j`` with ``d`` removed — and the window ends; when every
draft was accepted, one more token is drawn from the last row's ``p``. Each emitted token then
has exactly the target's distribution given the tokens before it (Leviathan et al. 2023,
Chen et al. 2023), so sampled outputs follow the target distribution whatever the drafter.

A greedy row (temperature below ``GREEDY_TEMPERATURE``) accepts while the draft is the row's
argmax, as ``engine/runner/verify.accept_greedy`` does. The draws use the request's own
generator (seeded requests stay reproducible run to run, though not token-identical to a run
without speculation: the draws are consumed differently).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from deltaserve.kernels.sampler import _filtered_sorted_probs, apply_min_p


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from for ``logits [L, V]`` under ``params`` (every
    row the same request's), in token order, normalised, float32 ``[L, V]``."""
    rows = logits.shape[0]
    temperature = torch.full((rows,), float(params.temperature), dtype=torch.float32, device=logits.device)
    if params.min_p > 0.0:
        logits = apply_min_p(logits, [params.min_p] * rows, temperature)
    top_k = torch.full((rows,), int(min(params.top_k, 2**62)), dtype=torch.long, device=logits.device)
    top_p = torch.full((rows,), float(params.top_p), dtype=torch.float32, device=logits.device)
    sorted_probs, order = _filtered_sorted_probs(logits, temperature, top_k, top_p)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def accept_sampled(
    logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams, generator: torch.Generator
) -> list[int]:
    """The tokens one verify segment emits (accepted drafts, then one drawn token), from its
    rows ``logits [len(drafts) + 1, V]``; see the module docstring."""
    if params.temperature < GREEDY_TEMPERATURE:
        targets = logits.float().argmax(dim=-1).tolist()
        a = 0
        while a < len(drafts) and targets[a] == drafts[a]:
            a += 1
        return [*drafts[:a], targets[a]]
    probs = target_probs(logits, params)
    device = probs.device
    for j, d in enumerate(drafts):
        u = torch.rand((), generator=generator, device=device)
        if bool(u < probs[j, d]):
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        if not bool(residual.sum() > 0):  # (p_j(d) == 1 is always accepted: defensive)
            return [*drafts[: j + 1]]
        token = int(torch.multinomial(residual, 1, generator=generator)[0])
        return [*drafts[:j], token]
    bonus = int(torch.multinomial(probs[len(drafts)], 1, generator=generator)[0])
    return [*drafts, bonus]
