"""RequestState: the engine-side state of one request, beside the torch-free scheduler ``Request``.

``EngineCore.states`` keeps one per running request (created when the request is added,
dropped when it ends). It holds what the scheduler must not see: the stop
ids, the request's seeded generator, the tensors the sampler builds once per request and
the prompt log-probabilities the runner fills in while it computes the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.engine.outputs import TokenLogprob


@dataclass(eq=False)
class RequestState:
    """Engine-side state of one request, kept by ``EngineCore.states`` beside the torch-free
    scheduler ``Request`` (created at ``add_request``, dropped when the request ends)."""

    stop_ids: frozenset[int]  # stop_token_ids, plus the model's EOS ids unless ignore_eos
    generator: torch.Generator | None  # per-request RNG when SamplingParams.seed is set
    # log-probabilities of the tokens sampled since the engine last took them (logprobs requests)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_ids: torch.Tensor | None = None  # the prompt as a tensor, built once (repetition penalty)
    # SamplingParams.prompt_logprobs: one entry per prompt position (None at 0), filled by the
    # runner's forwards of the prompt and handed out with the request's first token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # greedy with nothing before the argmax (``sampling.plain_greedy(params)``): a batch of only
    # such rows samples with one argmax
    plain_greedy: bool = False
    # the constraint's matcher (``engine/grammar.py``), advanced by every accepted token; None
    # for an unconstrained request
    matcher: Any = None
