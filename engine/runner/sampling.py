"""Sampler: one token per logits row of a step, and the log-probabilities the rows asked for.

Two paths, chosen per step by the model runner:

* ``greedy``: every row plain greedy (``plain_greedy``: no penalties, min-p or
  log-probabilities, decided once per request). One argmax over the batch, first index on
  ties (and the first NaN, like torch), which is what the ``sample`` op does for greedy rows,
  without building per-row parameter tensors.
* ``Sampler.sample_rows``: the general path. Penalties, then min-p, on the rows that use
  them (``kernels/sampler.py``), then the ``sample`` op with each row's generator (its seeded
  one, else the engine's shared one); raw log-probabilities for the rows that asked.

A constrained row (``SamplingParams.constraint``) has its logits masked first, in place
(``apply_token_mask``: one bitmask for the step's rows, applied to the constrained ones only),
whichever path samples; its log-probabilities are then those of the masked logits.

Tokens stay on the device; only the rows that asked for log-probabilities bring theirs to the
host. The caller resolves placeholder tokens (async scheduling) before they reach the penalties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.runner.request_state import RequestState
from deltaserve.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from deltaserve.kernels import Ops
from deltaserve.kernels.sampler import apply_min_p, apply_penalties, compute_logprobs
from deltaserve.scheduler.request import Request


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing before the argmax: no penalties, no min-p, no log-probabilities."""
    return (
        p.temperature < GREEDY_TEMPERATURE and p.logprobs is None and p.min_p <= 0.0 and not p.has_penalties
    )


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of every row (first index on ties), on the logits' device."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy's row argmax is an order of magnitude faster than torch's on the CPU
        return torch.from_numpy(logits.contiguous().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: in each logits row of ``rows``, the tokens its bitmask row forbids get
    ``-inf``. ``bitmask`` (int32, one row per logits row, bit ``t % 32`` of word ``t // 32``
    set = token ``t`` allowed; ids past its width are forbidden) is copied to the logits'
    device; rows not in ``rows`` are untouched."""
    import xgrammar as xgr

    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    vocab = logits.shape[-1]
    covered = bitmask.shape[-1] * 32
    if vocab > covered:  # (the kernel only reads the bitmask's width)
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits[index, covered:] = float("-inf")
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, covered), indices=rows)


class Sampler:
    """The general row sampler. Row ``i`` of the logits belongs to ``reqs[i]`` with
    ``params[i]`` and ``states[i]``; ``output_ids[i]`` are the output tokens its penalties count
    (real ids: placeholders resolved)."""

    def __init__(self, ops: Ops, device: torch.device) -> None:
        self.ops = ops
        self.device = device
        # draws of the requests without a seed (EngineCore seeds it from model.seed)
        self.default_generator = torch.Generator(device=device)

    def sample_rows(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        params: Sequence[SamplingParams],
        states: Sequence[RequestState],
        output_ids: Sequence[list[int]],
    ) -> tuple[torch.Tensor, list[TokenLogprob | None] | None]:
        """The tokens (on the device) and, when some row asked, every row's log-probabilities
        (None for the rows that did not)."""
        dev = self.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        raw = logits
        logits = self._penalise(logits, reqs, params, states, output_ids)
        logits = self._min_p(logits, raw, params, temperature)
        tokens = self.ops.sample(
            logits,
            temperature,
            torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            [st.generator or self.default_generator for st in states],
        )
        return tokens, self._logprobs(raw, tokens, params)

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _penalise(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        params: Sequence[SamplingParams],
        states: Sequence[RequestState],
        output_ids: Sequence[list[int]],
    ) -> torch.Tensor:
        """Repetition, frequency and presence penalties on the rows that have them (a float32
        copy of the logits when any row does: the raw logits stay for log-probabilities)."""
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return logits
        sub = [params[i] for i in rows]
        prompts = None
        if any(p.repetition_penalty != 1.0 for p in sub):
            prompts = []
            for i in rows:
                st = states[i]
                if st.prompt_ids is None:
                    st.prompt_ids = self._index(reqs[i].prompt_token_ids)
                prompts.append(st.prompt_ids)
        index = self._index(rows)
        logits = logits.float().clone()
        logits[index] = apply_penalties(
            logits[index],
            [output_ids[i] for i in rows],
            [p.presence_penalty for p in sub],
            [p.frequency_penalty for p in sub],
            [p.repetition_penalty for p in sub],
            prompts,
        )
        return logits

    def _min_p(
        self,
        logits: torch.Tensor,
        raw: torch.Tensor,
        params: Sequence[SamplingParams],
        temperature: torch.Tensor,
    ) -> torch.Tensor:
        """Min-p on the rows that set it (into a float32 copy unless the penalties made one)."""
        rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if not rows:
            return logits
        index = self._index(rows)
        if logits is raw:
            logits = logits.float().clone()
        logits[index] = apply_min_p(logits[index], [params[i].min_p for i in rows], temperature[index])
        return logits

    def _logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
    ) -> list[TokenLogprob | None] | None:
        """Raw log-probabilities of the chosen tokens and their top alternatives, for the rows
        that asked; None when no row did."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        index = self._index(rows)
        k = max(params[i].logprobs or 0 for i in rows)
        chosen, rank, top_ids, top_lp = compute_logprobs(raw[index], tokens[index], k)
        chosen_l, rank_l, ids_l, lp_l = chosen.tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist()
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        for j, i in enumerate(rows):
            n_top = params[i].logprobs or 0
            logprobs[i] = TokenLogprob(
                token_id=token_list[i],
                logprob=chosen_l[j],
                rank=rank_l[j],
                top=list(zip(ids_l[j][:n_top], lp_l[j][:n_top], strict=True)),
            )
        return logprobs
