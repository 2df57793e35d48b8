"""sample(): greedy, top-k, top-p, per-row generators, and distribution sanity checks."""

from __future__ import annotations

import torch

from deltaserve.kernels.sampler import GREEDY_TEMPERATURE, sample


def _params(
    rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.full((rows,), temperature),
        torch.full((rows,), top_k, dtype=torch.long),
        torch.full((rows,), top_p),
    )


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_is_argmax_whatever_the_filters(rng: torch.Generator) -> None:
    logits = torch.randn(6, 50, generator=rng)
    temperature = torch.zeros(6)
    top_k = torch.tensor([0, 1, 5, -1, 100, 3])
    top_p = torch.tensor([1.0, 0.5, 0.1, 0.9, 1.0, 0.0])
    gens = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(6)]
    tokens = sample(logits, temperature, top_k, top_p, gens)
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy(rng: torch.Generator) -> None:
    logits = torch.randn(8, 100, generator=rng)
    for _ in range(5):
        t, k, p = _params(8, temperature=1.5, top_k=1)
        assert torch.equal(sample(logits, t, k, p, [None] * 8), logits.argmax(-1))
        t, k, p = _params(8, temperature=1.5, top_p=1e-6)
        gens = [torch.Generator().manual_seed(i) for i in range(8)]
        assert torch.equal(sample(logits, t, k, p, gens), logits.argmax(-1))
        # top_p = 0 still keeps the most likely token rather than failing the draw.
        t, k, p = _params(8, temperature=1.5, top_p=0.0)
        assert torch.equal(sample(logits, t, k, p, gens), logits.argmax(-1))


def test_mixed_batch_greedy_rows_untouched(rng: torch.Generator) -> None:
    logits = torch.randn(4, 30, generator=rng)
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7])
    tokens = sample(logits, temperature, torch.zeros(4, dtype=torch.long), torch.ones(4), [None] * 4)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_row_independent_of_batch_composition(rng: torch.Generator) -> None:
    vocab = 64
    target = torch.randn(vocab, generator=rng)
    alone_gen = torch.Generator().manual_seed(1234)
    batched_gen = torch.Generator().manual_seed(1234)
    for step in range(10):
        alone = sample(target[None], [0.8], [20], [0.9], [alone_gen])
        # Each step: a different batch size, position and neighbours (seeded, unseeded, greedy).
        others = torch.randn(step % 4 + 1, vocab, generator=rng)
        position = step % (others.shape[0] + 1)
        logits = torch.cat([others[:position], target[None], others[position:]])
        rows = logits.shape[0]
        gens = [torch.Generator().manual_seed(step * 10 + i) if i % 2 else None for i in range(rows)]
        gens[position] = batched_gen
        temperature = torch.tensor([0.0 if i % 3 == 2 else 1.3 for i in range(rows)])
        temperature[position] = 0.8
        top_k = torch.full((rows,), 7, dtype=torch.long)
        top_k[position] = 20
        top_p = torch.full((rows,), 0.5)
        top_p[position] = 0.9
        batched = sample(logits, temperature, top_k, top_p, gens)
        assert batched[position] == alone[0], f"step {step}"


def test_same_seed_same_tokens_in_one_batch(rng: torch.Generator) -> None:
    row = torch.randn(1, 40, generator=rng)
    logits = torch.cat([row, torch.randn(2, 40, generator=rng), row])
    gens = [
        torch.Generator().manual_seed(7),
        None,
        torch.Generator().manual_seed(9),
        torch.Generator().manual_seed(7),
    ]
    for _ in range(10):
        tokens = sample(logits, *_params(4), gens)
        assert tokens[0] == tokens[3]


def test_distribution_unfiltered_global_rng() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    rows = 20000
    logits = (probs.log() * 2.0).expand(rows, -1)  # temperature 2 undoes the factor 2
    tokens = sample(logits, *_params(rows, temperature=2.0), [None] * rows)
    counts = torch.bincount(tokens, minlength=6).double()
    assert _chi_square(counts, probs.double()) < 35.0  # 5 dof: p ~ 1e-6


def test_distribution_seeded_rows_with_top_k() -> None:
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    rows = 3000
    logits = probs.log().expand(rows, -1)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    tokens = sample(logits, *_params(rows, top_k=3), gens)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[0] == 0 and counts[2] == 0  # outside the top 3
    kept = torch.tensor([1, 3, 4])
    assert _chi_square(counts[kept], (probs[kept] / probs[kept].sum()).double()) < 30.0


def test_distribution_top_p() -> None:
    torch.manual_seed(1)
    probs = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05])
    rows = 10000
    logits = probs.log().expand(rows, -1)
    # Sorted: 0.5, 0.3, 0.1, ...; mass before the 3rd token is 0.8 >= 0.75, so only two survive.
    tokens = sample(logits, *_params(rows, top_p=0.75), [None] * rows)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[[0, 2, 4]].sum() == 0
    kept = torch.tensor([1, 3])
    assert _chi_square(counts[kept], (probs[kept] / probs[kept].sum()).double()) < 30.0
    # 0.85 > 0.8: the third token (0.1) is needed to reach the mass, so it is kept.
    tokens = sample(logits[:2000], *_params(2000, top_p=0.85), [None] * 2000)
    assert set(tokens.tolist()) == {0, 1, 3}


def test_masked_tokens_never_sampled(rng: torch.Generator) -> None:
    logits = torch.randn(500, 10, generator=rng)
    logits[:, 3:] = float("-inf")
    tokens = sample(logits, *_params(500, temperature=5.0), [None] * 500)
    assert (tokens < 3).all()


# ---------------------------------------------------------------------- total on any values
def test_huge_python_top_k_is_top_k_off(rng: torch.Generator) -> None:
    logits = torch.randn(3, 40, generator=rng)
    for huge in (2**63, 2**64, 10**400):
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        off = [torch.Generator().manual_seed(i) for i in range(3)]
        tokens = sample(logits, [1.0] * 3, [huge, 0, huge], [1.0] * 3, gens)
        assert torch.equal(tokens, sample(logits, [1.0] * 3, [0] * 3, [1.0] * 3, off))
    # a tensor top_k far beyond the vocabulary is off too
    tokens = sample(logits, [1.0] * 3, torch.full((3,), 2**62), [1.0] * 3, [None] * 3)
    assert ((tokens >= 0) & (tokens < 40)).all()


def test_tiny_temperatures_are_greedy_and_never_nan(rng: torch.Generator) -> None:
    logits = torch.randn(4, 50, generator=rng) * 30.0
    for t in (1e-38, 1e-30, 1e-8, 9.9e-6, -1.0, float("nan")):
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        assert torch.equal(sample(logits, [t] * 4, [0] * 4, [1.0] * 4, gens), logits.argmax(-1)), t
    # at the threshold the row samples (no longer the greedy path), from a finite distribution
    # that is all but one-hot on the argmax
    big = torch.randn(4, 50, generator=rng) * 1e4
    assert torch.equal(sample(big, [GREEDY_TEMPERATURE] * 4, [0] * 4, [1.0] * 4, [None] * 4), big.argmax(-1))


def test_huge_temperature_is_near_uniform_and_keeps_masks(rng: torch.Generator) -> None:
    logits = torch.randn(2000, 6, generator=rng)
    logits[:, 4:] = float("-inf")
    for t in (1e30, 1e300, float("inf")):  # 1e300 and inf are inf in float32
        tokens = sample(logits, [t] * 2000, [0] * 2000, [1.0] * 2000, [None] * 2000)
        counts = torch.bincount(tokens, minlength=6)
        assert counts[4:].sum() == 0 and (counts[:4] > 350).all(), (t, counts)


def test_non_finite_logits_never_fail_the_batch(rng: torch.Generator) -> None:
    vocab = 30
    good = torch.randn(vocab, generator=rng)
    alone = sample(good[None], [0.9], [5], [0.8], [torch.Generator().manual_seed(3)])
    nan_row = torch.full((vocab,), float("nan"))
    masked_row = torch.full((vocab,), float("-inf"))
    inf_row = torch.randn(vocab, generator=rng)
    inf_row[17] = float("inf")
    some_nan = torch.randn(vocab, generator=rng)
    some_nan[::2] = float("nan")
    logits = torch.stack([nan_row, masked_row, good, inf_row, some_nan])
    temperature, top_k, top_p = [0.9] * 5, [5, 0, 5, 0, 0], [1.0, 1.0, 0.8, 1.0, 0.5]
    for _ in range(20):
        tokens = sample(logits, temperature, top_k, top_p, [None] * 5)
        assert ((tokens >= 0) & (tokens < vocab)).all()
        assert tokens[3] == 17  # an infinite logit wins
        assert tokens[4] % 2 == 1  # a NaN logit is never drawn
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(3), None, None]
    tokens = sample(logits, temperature, top_k, top_p, gens)
    assert tokens[2] == alone[0]  # the bad rows did not change the good one's draw


def test_nan_top_p_and_temperature_do_not_raise(rng: torch.Generator) -> None:
    logits = torch.randn(3, 20, generator=rng)
    tokens = sample(logits, [float("nan"), 1.0, 1.0], [0, 0, -(2**70)], [1.0, float("nan"), -1.0], [None] * 3)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()  # top_p <= 0: top token
    assert 0 <= tokens[1] < 20


# ---------------------------------------------------------------------- processors and logprobs
def test_penalties_match_their_definitions(rng: torch.Generator) -> None:
    from deltaserve.kernels.sampler import apply_penalties

    logits = torch.randn(3, 12, generator=rng) * 3
    outputs = [[1, 1, 4], [], [11, 0, 0, 0]]
    prompts = [[2, 3], [5], [4]]
    got = apply_penalties(logits, outputs, [0.5, 1.0, -0.3], [0.25, 2.0, 0.1], [1.0, 1.5, 2.0], prompts)
    want = logits.clone()
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        presence, frequency, rep = [0.5, 1.0, -0.3][i], [0.25, 2.0, 0.1][i], [1.0, 1.5, 2.0][i]
        for t in set(out) | set(prompt):
            want[i, t] = want[i, t] / rep if want[i, t] > 0 else want[i, t] * rep
        for t in set(out):
            want[i, t] -= frequency * out.count(t) + presence
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[1], logits[1].where(torch.arange(12) != 5, got[1]))  # row 1: only the prompt token
    # no repetition penalty anywhere: prompts are not needed
    got = apply_penalties(logits, outputs, [0.5] * 3, [0.0] * 3, [1.0] * 3)
    assert torch.allclose(got[0, 1], logits[0, 1] - 0.5) and torch.equal(got[1], logits[1])


def test_min_p_is_relative_to_the_tempered_top_token() -> None:
    from deltaserve.kernels.sampler import apply_min_p

    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    logits = probs.log()[None].repeat(3, 1)
    out = apply_min_p(logits, [0.2, 0.2, 0.5], [1.0, 0.0, 2.0])
    assert torch.isinf(out[0]).tolist() == [False, False, False, True]  # 0.08 < 0.2 * 0.5
    assert torch.equal(out[1], logits[1])  # greedy: untouched
    # T = 2: tempered probs ~ sqrt(p); 0.08 -> sqrt(0.08/0.5) = 0.4 < 0.5, 0.12 -> 0.49 < 0.5
    assert torch.isinf(out[2]).tolist() == [False, False, True, True]
    for _ in range(50):
        assert sample(out[:1], [1.0], [0], [1.0], [None])[0] != 3


def test_logprobs_are_raw_log_softmax(rng: torch.Generator) -> None:
    from deltaserve.kernels.sampler import compute_logprobs

    logits = torch.randn(4, 30, generator=rng)
    tokens = torch.tensor([0, 5, 29, 7])
    chosen, rank, top_ids, top_lp = compute_logprobs(logits, tokens, 3)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(chosen.double(), ref[torch.arange(4), tokens], atol=1e-5)
    assert torch.equal(top_ids, ref.topk(3, -1).indices)
    assert torch.allclose(top_lp.double(), ref.topk(3, -1).values, atol=1e-5)
    assert rank.tolist() == [int((ref[i] > ref[i, t]).sum()) + 1 for i, t in enumerate(tokens.tolist())]
    _, _, ids0, lp0 = compute_logprobs(logits, tokens, 0)
    assert ids0.shape == (4, 0) and lp0.shape == (4, 0)
