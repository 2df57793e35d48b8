"""``SamplingParams.prompt_logprobs``: every prompt position's log-probabilities equal a
transformers forward's ``log_softmax`` (fp32, the built-in tiny model), whole or chunked, plain
or overlapped loop; such a request takes no prefix hit; the others are unaffected.

Tolerance: ``log_softmax(x)_i = x_i - logsumexp(x)`` and logsumexp is 1-Lipschitz in the max
norm, so logits within ``b`` of the reference (tests/tolerances.py, per row) give
log-probabilities within ``2 b``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.errors import InvalidRequestError
from deltaserve.engine.outputs import RequestOutput, TokenLogprob
from deltaserve.scheduler.scheduler import WHOLE_PROMPT_CHUNK
from tests.engine.conftest import greedy, make_config, run_to_completion
from tests.tolerances import CPU_FP32, GPU_FP32, LogitTolerance

TOP = 5


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _reference(hf_model: Any, prompt: list[int], tol: LogitTolerance) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-probabilities at every prompt position (float64 from fp32 logits) and
    each row's bound (twice the logits tolerance)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits.double(), dim=-1), 2 * tol.bound(logits)[:, 0]


def _check(
    entries: list[TokenLogprob | None],
    prompt: list[int],
    hf_model: Any,
    top: int,
    tol: LogitTolerance = CPU_FP32,
) -> None:
    ref, bound = _reference(hf_model, prompt, tol)
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for p in range(1, len(prompt)):
        e = entries[p]
        assert e is not None, f"position {p} missing"
        row, b = ref[p - 1], float(bound[p - 1])
        assert e.token_id == prompt[p]
        assert abs(e.logprob - row[prompt[p]].item()) <= b, f"position {p}"
        # the rank counts the tokens clearly above it, and at most those within the tolerance too
        assert (
            int((row > row[prompt[p]] + 2 * b).sum()) + 1
            <= e.rank
            <= int((row > row[prompt[p]] - 2 * b).sum()) + 1
        )
        assert len(e.top) == top
        lps = [lp for _, lp in e.top]
        assert lps == sorted(lps, reverse=True)
        for tid, lp in e.top:
            assert abs(lp - row[tid].item()) <= b
        if top:  # nothing left out is clearly more likely than the last one kept
            rest = row.clone()
            rest[[tid for tid, _ in e.top]] = -float("inf")
            assert rest.max().item() <= lps[-1] + 2 * b


def _run(
    core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[RequestOutput]]:
    reqs = [core.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for r in reqs:
        core.add_request(r)
    outs = run_to_completion(core)
    return [outs[r.request_id] for r in reqs]


def _prompt_entries(outs: list[RequestOutput]) -> list[TokenLogprob | None]:
    """The prompt log-probabilities: on the first output, and only there."""
    assert outs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    return outs[0].prompt_logprobs


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "async"])
@pytest.mark.parametrize("budget", [1024, 64], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(
    core_factory: Callable[..., EngineCore], hf_tiny: Any, budget: int, overlap: bool
) -> None:
    core = core_factory(**{"scheduler.max_num_batched_tokens": budget, "engine.async_scheduling": overlap})
    vocab = core.vocab_size
    prompts = [_prompt(vocab, n, seed) for seed, n in enumerate([200, 2, 65, 130])]
    params = [
        greedy(3, prompt_logprobs=TOP),
        greedy(1, prompt_logprobs=0),
        greedy(2, prompt_logprobs=1),
        greedy(4),
    ]
    results = _run(core, prompts, params)
    for prompt, outs, sp in zip(prompts[:3], results[:3], params[:3], strict=True):
        entries = _prompt_entries(outs)
        _check(entries, prompt, hf_tiny, sp.prompt_logprobs or 0)
        assert outs[0].prompt_token_ids == prompt
        assert outs[-1].num_cached_tokens == 0
    assert all(o.prompt_logprobs is None and o.prompt_token_ids is None for o in results[3])


def test_prompt_logprobs_skip_a_warm_prefix_hit(
    core_factory: Callable[..., EngineCore], hf_tiny: Any
) -> None:
    """With the prompt cached, a prompt-logprobs request still computes it all (no hit) and gets
    exactly the cold result; the cache still serves the next plain request."""
    prompt = _prompt(256, 300, seed=7)
    cold_core = core_factory(**{"scheduler.max_num_batched_tokens": 128})
    cold = _prompt_entries(_run(cold_core, [prompt], [greedy(2, prompt_logprobs=TOP)])[0])

    core = core_factory(**{"scheduler.max_num_batched_tokens": 128})
    [plain] = _run(core, [prompt], [greedy(2)])
    [again] = _run(core, [prompt], [greedy(2)])
    assert again[-1].num_cached_tokens > 0, "the prompt is cached"
    [warm] = _run(core, [prompt], [greedy(2, prompt_logprobs=TOP)])
    assert warm[-1].num_cached_tokens == 0
    assert _prompt_entries(warm) == cold
    assert [t for o in warm for t in o.token_ids] == [t for o in plain for t in o.token_ids]
    [after] = _run(core, [prompt], [greedy(2)])
    assert after[-1].num_cached_tokens == again[-1].num_cached_tokens
    _check(cold, prompt, hf_tiny, TOP)


def test_a_batch_neighbour_keeps_its_hit_and_its_logits_rows(core_factory: Callable[..., EngineCore]) -> None:
    """A plain request beside a prompt-logprobs one takes its prefix hit; steps without such a
    request compute one logits row per sampled sequence."""
    core = core_factory(**{"scheduler.max_num_batched_tokens": 128})
    prompt = _prompt(256, 200, seed=3)
    _run(core, [prompt], [greedy(2)])
    rows: list[tuple[int, int]] = []
    forward = core.runner.model.forward

    def counting(batch: Any, caches: Any) -> torch.Tensor:
        logits = forward(batch, caches)
        rows.append((int(batch.logits_indices.numel()), int(logits.shape[0])))
        return logits

    core.runner.model.forward = counting  # type: ignore[method-assign]
    neighbour, asking = _run(core, [prompt, prompt], [greedy(2), greedy(2, prompt_logprobs=0)])
    assert neighbour[-1].num_cached_tokens == 192  # the deepest checkpoint below 200
    assert asking[-1].num_cached_tokens == 0
    assert neighbour[0].prompt_logprobs is None
    # the prompt-logprobs request's steps have its 199 predicting positions on top
    assert sum(n for n, _ in rows) == 199 + 2 + 2
    rows.clear()
    _run(core, [prompt], [greedy(3)])
    assert rows == [(1, 1)] * 3


def test_prompt_logprobs_range_is_checked() -> None:
    with pytest.raises(
        InvalidRequestError,
        match=r"SamplingParams.prompt_logprobs=21: must be None or an integer in \[0, 20\]",
    ):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs=-1"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device (and TRITON_INTERPRET unset)",
)
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "async"])
def test_prompt_logprobs_on_gpu(tiny_path: Any, hf_tiny: Any, overlap: bool) -> None:
    """The Triton kernels on CUDA (fp32), chunked: within tests/tolerances.py's ``GPU_FP32``."""
    core = EngineCore(
        make_config(**{
            "model.path": str(tiny_path),
            "model.device": "cuda",
            "model.dtype": "float32",
            "kernels.backend": "triton",
            "scheduler.max_num_batched_tokens": 64,
            "engine.async_scheduling": overlap,
        })
    )  # fmt: skip
    prompts = [_prompt(core.vocab_size, n, seed) for seed, n in enumerate([200, 65, 3])]
    results = _run(core, prompts, [greedy(2, prompt_logprobs=TOP), greedy(3, prompt_logprobs=1), greedy(2)])
    for prompt, outs, top in zip(prompts[:2], results[:2], [TOP, 1], strict=True):
        _check(_prompt_entries(outs), prompt, hf_tiny, top, GPU_FP32)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "async"])
def test_prompt_logprobs_survive_preemption(
    core_factory: Callable[..., EngineCore], hf_tiny: Any, overlap: bool
) -> None:
    """A KV pool too small for the batch: requests are preempted and recompute; every prompt's
    entries still match, and come out once."""
    core = core_factory(**{"cache.num_kv_blocks": 24, "engine.async_scheduling": overlap})
    prompts = [_prompt(core.vocab_size, n, seed) for seed, n in enumerate((40, 45, 50, 55, 60, 65))]
    results = _run(core, prompts, [greedy(40, prompt_logprobs=2) for _ in prompts])
    assert core.stats()["scheduler.preemptions"] > 0
    for prompt, outs in zip(prompts, results, strict=True):
        assert outs[-1].finish_reason == "length"
        _check(_prompt_entries(outs), prompt, hf_tiny, 2)


def test_prompt_logprobs_after_a_preemption_mid_prompt(
    core_factory: Callable[..., EngineCore], hf_tiny: Any
) -> None:
    """Preempted after its first chunk, the request computes its prompt again from the start
    (still no hit, although its first chunk was published) and its entries are whole."""
    core = core_factory(**{"scheduler.max_num_batched_tokens": 64})
    prompt = _prompt(core.vocab_size, 200, seed=9)
    req = core.make_request(prompt, greedy(3, prompt_logprobs=TOP))
    core.add_request(req)
    assert core.step() == []  # the first chunk
    assert req.num_computed_tokens == 64
    core.scheduler._preempt(req)
    core.check_integrity()
    outs = run_to_completion(core)[req.request_id]
    assert core.stats()["scheduler.preemptions"] == 1
    assert core.counters["tokens.computed"] >= 64 + 200
    _check(_prompt_entries(outs), prompt, hf_tiny, TOP)


def test_a_long_prompt_is_computed_in_bounded_pieces(
    core_factory: Callable[..., EngineCore], hf_tiny: Any
) -> None:
    """Its logits rows are ``[tokens, vocab]``: a prompt-logprobs request computes at most
    ``WHOLE_PROMPT_CHUNK`` prompt tokens per step, whatever the token budget; the others don't."""
    core = core_factory(**{"scheduler.max_num_batched_tokens": 2048})
    rows: list[int] = []
    forward = core.runner.model.forward

    def counting(batch: Any, caches: Any) -> torch.Tensor:
        rows.append(int(batch.logits_indices.numel()))
        return forward(batch, caches)

    core.runner.model.forward = counting  # type: ignore[method-assign]
    prompt = _prompt(core.vocab_size, 1300, seed=11)
    [outs] = _run(core, [prompt], [greedy(1, prompt_logprobs=0)])
    assert rows == [WHOLE_PROMPT_CHUNK, WHOLE_PROMPT_CHUNK, 1300 - 1 - 2 * WHOLE_PROMPT_CHUNK + 1]
    _check(_prompt_entries(outs), prompt, hf_tiny, 0)
    rows.clear()
    _run(core, [_prompt(core.vocab_size, 1300, seed=12)], [greedy(1)])
    assert rows == [1]  # one step, one row
