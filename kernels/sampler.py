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

Logits processors the runner applies *before* ``sample`` (each a row-wise, vectorised torch op
over the rows that need it; ``sample``'s contract is unchanged):

* ``apply_penalties``: repetition (prompt and output tokens), frequency and presence penalties
  (output tokens), vLLM's / OpenAI's definitions;
* ``apply_min_p``: min-p filtering expressed on the raw logits: after dividing by the
  temperature, ``p_i < min_p * p_max`` is ``logit_i < logit_max + T * log(min_p)``, so masking
  those logits before ``sample`` is exactly min-p applied after the temperature and before
  top-k / top-p (vLLM's order);

and ``compute_logprobs`` returns log-probabilities of the chosen tokens and the top-k
alternatives. They are the *raw* model log-probabilities (log-softmax of the logits the model
produced, before penalties, temperature and filtering): vLLM's default (``raw_logprobs``), and
what a client comparing models or scoring text wants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["GREEDY_TEMPERATURE", "apply_min_p", "apply_penalties", "compute_logprobs", "sample"]

GREEDY_TEMPERATURE = 1e-5  # rows below it are greedy (engine/sampling_params.py documents it)
_TOP_K_CLAMP = 2**62  # Python top_k values beyond any vocabulary are clamped before int64


def _per_row(
    logits: torch.Tensor, **params: torch.Tensor | Sequence[float] | Sequence[int]
) -> list[torch.Tensor]:
    """Each parameter as a ``[B]`` tensor on ``logits.device`` (int64 for ``top_k``, float32 for
    the others), checked in order to have one entry per row of ``logits [B, V]``."""
    rows, _ = logits.shape
    out: list[torch.Tensor] = []
    for name, values in params.items():
        dtype = torch.long if name == "top_k" else torch.float32
        if dtype == torch.long and not isinstance(values, torch.Tensor):
            values = [min(max(int(v), -1), _TOP_K_CLAMP) for v in values]  # 2**63 would overflow int64
        tensor = torch.as_tensor(values, dtype=dtype).to(logits.device).reshape(-1)
        if tensor.numel() != rows:
            raise ValueError(f"{name} has {tensor.numel()} entries for {rows} rows of logits")
        out.append(tensor)
    return out


def _check_rows(items: Sequence[object], rows: int, what: str) -> None:
    """One of ``items`` (``what`` in the message) per row of the logits."""
    if len(items) != rows:
        raise ValueError(f"{len(items)} {what} for {rows} rows of logits")


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
    temperature, top_k, top_p = _per_row(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    _check_rows(generators, rows, "generators")

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


# ---------------------------------------------------------------------------- logits processors
def _row_counts(
    token_ids: Sequence[Sequence[int] | torch.Tensor], vocab: int, device: torch.device
) -> torch.Tensor:
    """``[B, V]`` float32 occurrence counts of each row's token ids (ids outside ``[0, V)`` are
    ignored), from one flat bincount: no per-token Python work beyond building the id list."""
    rows = len(token_ids)
    parts = [torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(device) for ids in token_ids]
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.long, device=device)
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
    row = torch.repeat_interleave(torch.arange(rows, device=device), lengths)
    keep = (flat >= 0) & (flat < vocab)
    index = row[keep] * vocab + flat[keep]
    return torch.bincount(index, minlength=rows * vocab).view(rows, vocab).float()


def apply_penalties(
    logits: torch.Tensor,
    output_token_ids: Sequence[Sequence[int] | torch.Tensor],
    presence_penalty: torch.Tensor | Sequence[float],
    frequency_penalty: torch.Tensor | Sequence[float],
    repetition_penalty: torch.Tensor | Sequence[float],
    prompt_token_ids: Sequence[Sequence[int] | torch.Tensor] | None = None,
) -> torch.Tensor:
    """Penalised float32 copy of ``logits [B, V]``; row ``i`` uses the tokens it has generated
    (``output_token_ids[i]``) and, for the repetition penalty, its prompt too.

    In vLLM's order: repetition (a token seen in the prompt or the output: a positive logit is
    divided by ``r``, a negative one multiplied; ``r = 1`` off), then frequency
    (``logit -= f * count``) and presence (``logit -= p * (count > 0)``), both over output tokens
    only (OpenAI's definition). ``prompt_token_ids`` may be None when no row has ``r != 1``.
    """
    rows, vocab = logits.shape
    device = logits.device
    presence, frequency, repetition = _per_row(
        logits,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
    )
    _check_rows(output_token_ids, rows, "output token lists")
    out = logits.float().clone()
    counts = _row_counts(output_token_ids, vocab, device)
    seen = counts > 0
    if prompt_token_ids is not None:
        _check_rows(prompt_token_ids, rows, "prompt token lists")
        seen_any = seen | (_row_counts(prompt_token_ids, vocab, device) > 0)
        r = repetition[:, None]
        penalised = torch.where(out > 0, out / r, out * r)
        out = torch.where(seen_any & (r != 1.0), penalised, out)
    out -= frequency[:, None] * counts
    out -= presence[:, None] * seen.float()
    return out


def apply_min_p(
    logits: torch.Tensor, min_p: torch.Tensor | Sequence[float], temperature: torch.Tensor | Sequence[float]
) -> torch.Tensor:
    """A copy of ``logits [B, V]`` with the tokens min-p drops set to ``-inf``: those whose
    probability after the temperature is below ``min_p * p_max``. Rows with ``min_p <= 0`` or a
    greedy temperature are unchanged (the most likely token is always kept)."""
    min_p, temperature = _per_row(logits, min_p=min_p, temperature=temperature)
    out = logits.float().clone()
    active = (min_p > 0) & (temperature >= GREEDY_TEMPERATURE)
    # log(p_i / p_max) = (l_i - l_max) / T  <  log(min_p)   <=>   l_i < l_max + T * log(min_p)
    top = torch.nan_to_num(out, nan=float("-inf")).amax(dim=-1)
    threshold = top + temperature * torch.log(min_p.clamp(min=math.ulp(0.0)))
    drop = (out < threshold[:, None]) & active[:, None]
    return out.masked_fill(drop, float("-inf"))


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log-probabilities (``log_softmax`` of ``logits [B, V]`` in float32).

    Returns the chosen token's log-probability ``[B]``, its rank (1 = most likely) ``[B]``, and
    the ``num_top`` most likely tokens' ids ``[B, k]`` and log-probabilities ``[B, k]``
    (descending). NaN logits give NaN log-probabilities (they are
    reported, never used to sample).
    """
    rows, vocab = logits.shape
    lp = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.as_tensor(token_ids, dtype=torch.long).to(logits.device).reshape(rows, 1)
    chosen = lp.gather(1, tokens)
    rank = (lp > chosen).sum(dim=-1) + 1
    k = max(0, min(int(num_top), vocab))
    if k:
        top_lp, top_ids = torch.topk(lp, k, dim=-1, sorted=True)
    else:
        top_lp = lp.new_zeros(rows, 0)
        top_ids = torch.zeros(rows, 0, dtype=torch.long, device=logits.device)
    return chosen.squeeze(-1), rank, top_ids, top_lp
