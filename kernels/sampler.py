"""Token sampler reference op: ``sample(logits, temperature, top_k, top_p, generators) -> [B] int64``.

Contract (docs/contracts.md, "Kernel ops"), per row ``i`` of ``logits [B, V]``:

* ``temperature[i] == 0`` (any value <= 0): greedy, ``argmax`` of the raw logits (first index on ties);
* otherwise ``logits / temperature``, then top-k (``top_k[i] <= 0`` or ``>= V``: off; exactly the
  ``k`` largest are kept, ties broken by lower token id), then top-p / nucleus on the renormalised
  top-k distribution (``top_p[i] >= 1``: off): keep the shortest prefix of the descending-sorted
  tokens whose mass reaches ``top_p``, and always the most likely token;
* the draw uses only ``generators[i]`` (a ``torch.Generator`` on ``logits.device``), or the global
  RNG when it is None. A row's token therefore depends only on its own logits, parameters and
  generator: a seeded request samples the same tokens whatever else is in the batch.

``temperature``, ``top_k`` and ``top_p`` are ``[B]`` tensors (Python sequences are accepted too).
All math in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["sample"]


def _per_row(
    values: torch.Tensor | Sequence[float] | Sequence[int],
    dtype: torch.dtype,
    rows: int,
    device: torch.device,
    name: str,
) -> torch.Tensor:
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
    sampled = [i for i, t in enumerate(temperature.tolist()) if t > 0]
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
