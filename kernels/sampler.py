"""Token sampler reference op: ``sample(logits, temperature, top_k, top_p, generators) -> [B] int64``.

Contract (docs/contracts.md, "Kernel ops"), per row ``i`` of ``logits [B, V]``:

* ``temperature[i] < GREEDY_TEMPERATURE`` (1e-5: so 0, negatives and NaN too): greedy, ``argmax`` of
  the raw logits (first index on ties). Greedy is the limit of sampling as the temperature goes to
  0, and dividing by a tinier temperature overflows float32 (inf - inf = NaN in the softmax);
* otherwise ``logits / temperature``, then top-k (``top_k[i] <= 0`` or ``>= V``: off; exactly the
  ``k`` largest are kept, ties broken by lower token id), then top-p / nucleus on the renormalised
  top-k distribution (``top_p[i] >= 1``: off): keep the shortest prefix of the descending-sorted
  tokens whose mass reaches ``top_p``, and always the most likely token;
* the draw uses only ``generators[i]`` (a ``torch.Generator`` on ``logits.device``), or the global
  RNG when it is None. A row's token therefore depends only on its own logits, parameters and
  generator: a seeded request samples the same tokens whatever else is in the batch.

``temperature``, ``top_k`` and ``top_p`` are ``[B]`` tensors (Python sequences are accepted too;
a Python ``top_k`` of any size is clamped, so it never overflows int64). All math in float32.

Total: no parameter value raises and no NaN reaches the draw. After scaling, a NaN logit counts
as ``-inf`` (never drawn) and ``+inf`` as the largest float32; a row whose filtered distribution
is still not a distribution (every logit NaN or ``-inf``) takes its first token in sorted order,
as greedy would. ``SamplingParams`` range-checks the values before they get here; this is the
second line of defence, so one request's values can never fail a step for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GREEDY_TEMPERATURE", "sample"]

GREEDY_TEMPERATURE = 1e-5  # rows below it are greedy (engine/sampling_params.py documents it)
_TOP_K_CLAMP = 2**62  # Python top_k values beyond any vocabulary are clamped before int64


def _per_row(
    values: torch.Tensor | Sequence[float] | Sequence[int],
    dtype: torch.dtype,
    rows: int,
    device: torch.device,
    name: str,
) -> torch.Tensor:
    if dtype == torch.long and not isinstance(values, torch.Tensor):
        values = [min(max(int(v), -1), _TOP_K_CLAMP) for v in values]  # 2**63 would overflow int64
    tensor = torch.as_tensor(values, dtype=dtype).to(device).reshape(-1)
    if tensor.numel() != rows:
        raise ValueError(f"{name} has {tensor.numel()} entries for {rows} rows of logits")
    return tensor


def _filtered_sorted_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k and top-p, in descending-logit order, with that order.

    Everything here is a row-wise op, so a row's result does not depend on the other rows.
    Working in sorted order makes top-k a prefix and top-p a cumulative sum; the stable sort makes
    the order (and so the filtering on ties) a function of the row alone.
    """
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature[:, None]
    # NaN (a NaN logit, or inf / inf) is never drawn; +inf is the largest value, so the softmax of
    # a row with an infinite logit is defined (it picks that token) instead of NaN.
    scaled = torch.nan_to_num(
        scaled, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf")
    )
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]

    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)

    # Drop a token when the mass of the more likely tokens before it already reaches top_p; the
    # first token has nothing before it and is always kept (also when top_p <= 0).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (rank > 0)
    probs = probs.masked_fill(drop, 0.0)
    # A row with no finite logit has NaN probabilities: it takes its first sorted token (what
    # greedy would) instead of failing the draw for the whole batch. No host sync here.
    valid = torch.isfinite(probs).all(dim=-1, keepdim=True) & (probs.sum(dim=-1, keepdim=True) > 0)
    probs = torch.where(valid, probs, (rank == 0).to(probs.dtype))
    # No renormalisation needed: multinomial takes unnormalised non-negative weights.
    return probs, order


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | Sequence[float],
    top_k: torch.Tensor | Sequence[int],
    top_p: torch.Tensor | Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Sample one token per row of ``logits [B, V]``; returns int64 ``[B]`` on ``logits.device``."""
    rows, _ = logits.shape
    device = logits.device
    temperature = _per_row(temperature, torch.float32, rows, device, "temperature")
    top_k = _per_row(top_k, torch.long, rows, device, "top_k")
    top_p = _per_row(top_p, torch.float32, rows, device, "top_p")
    if len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} rows of logits")

    tokens = logits.float().argmax(dim=-1)  # greedy rows keep this
    sampled = [i for i, t in enumerate(temperature.tolist()) if t >= GREEDY_TEMPERATURE]  # NaN: greedy
    if not sampled:
        return tokens

    index = torch.tensor(sampled, dtype=torch.long, device=device)
    probs, order = _filtered_sorted_probs(logits[index], temperature[index], top_k[index], top_p[index])
    choice = torch.empty(len(sampled), dtype=torch.long, device=device)  # position in sorted order
    unseeded = [j for j, i in enumerate(sampled) if generators[i] is None]
    if unseeded:
        # One batched draw from the global RNG: unseeded rows promise no reproducibility.
        at = torch.tensor(unseeded, dtype=torch.long, device=device)
        choice[at] = torch.multinomial(probs[at], 1).squeeze(-1)
    for j, i in enumerate(sampled):
        generator = generators[i]
        if generator is not None:
            # One row, one generator: the draw consumes only this request's RNG stream.
            choice[j] = torch.multinomial(probs[j], 1, generator=generator)[0]
    tokens[index] = order.gather(1, choice[:, None]).squeeze(-1)
    return tokens
