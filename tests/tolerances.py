"""How logits are compared: the one definition every logits-parity test uses.

Rule (:func:`assert_logits_close`), for every row (one position's logits) and every element::

    |actual - expected| <= atol + rtol * max_j |expected[row, j]|

CPU fp32 (``CPU_FP32``): ``atol = rtol = 1e-4``, i.e. ``1e-4 * (1 + the row's largest |logit|)``:
9e-4 .. 1.7e-3 for the test checkpoints (rows' largest |logit| 8 .. 16), 2.4e-3 .. 6.3e-3 for the
tied-embedding one (23 .. 61), ~2e-3 for the built-in models.

Why relative to the row's largest logit (not elementwise, not absolute)
------------------------------------------------------------------------
A logit is ``w_v . h`` (lm_head row times the final hidden state). fp32 error in ``h`` (``dh``) gives
``w_v . dh``, which does not shrink when a logit happens to be near zero, so an elementwise
``rtol * |expected|`` is meaningless for small logits; it scales with ``|w| |h|``, for which the
row's largest |logit| is the available proxy. Measured, ``max|error| / max|row|`` is ~5e-6 both
for rows of largest |logit| ~10 and for the tied config's rows up to 61, while the absolute
errors differ 3x. ``atol`` is a floor for rows whose logits are all below ~1 (none here: every row
has a largest |logit| >= 8), where cancellation leaves an error set by the summed terms.

Why this size: fp32 arithmetic, worst case vs typical
-----------------------------------------------------
fp32 has ``eps = 2**-23 ~ 1.19e-7`` (unit roundoff ``u = eps / 2``). A length-K reduction (dot
product, sum, scan) evaluated in any order, with or without FMA, blocked any way, is off by at
most ``~K * u * sum|terms|`` (worst case) and ``~sqrt(K) * u * sum|terms|`` typically (independent
roundings). Here K reaches ~512 (hidden/MLP widths 64 .. 512, attention and the GDN scan over up
to ~700 tokens), and a forward chains ~6 such reductions per layer over 3 .. 8 layers; RMSNorms
rescale activations but pass relative errors on. The worst-case bound (~3e-5 per op, ~1e-3
chained) is as large as real bugs (below), so it cannot set a tolerance; the typical estimate
(~1.4e-6 per op, ~1e-5 chained) is what is observed.

Two x86-64 CPUs (AVX2 vs AVX-512 kernels, thread counts, BLAS blocking) differ only in the order,
blocking, FMA use and vectorised transcendentals of those same fp32 operations. Each variant
approximates the same exact value, so its distance to a float64 run of the same model is its
rounding error, and another CPU, rounding the same operations in another order, must land at
the same order of distance; two fp32 results (ours vs transformers, warm vs cold) differ by at
most the sum of their distances. Measured on this AMD EPYC (AVX2), over every
logits row tests/models compares (~10k rows, 5 checkpoints; float64 = transformers' model in
float64; the scalar variant is ``ATEN_CPU_CAPABILITY=default``, ATen's non-vectorised kernels)::

    max |fp32 - float64| / max|row|          AVX2 kernels   scalar kernels
      ours (models/, reference ops)            4.9e-6         2.65e-5
      transformers                             6.4e-6         2.0e-5
    OMP_NUM_THREADS / torch threads 1 vs 2: ours moves <= 2.1e-5 absolute (7.8e-7 relative)
    ours vs transformers in one run (what the tests check): <= 9.1e-5 absolute (9.2e-6 relative)

As fractions of the tolerance: worst single fp32 run vs float64 0.24 (scalar kernels); worst
pairing of ours and transformers from different kernel variants 0.23; same run 0.084 (AVX2),
0.057 (scalar). A report from an AVX-512 Xeon (max |logit diff| 1.29e-4 in
test_capture[qwen3_5-gqa2-ratio2], rows of largest |logit| >= 8.2, so tolerance >= 9.2e-4) is
<= 0.14 of it. Margin: >= 4x over the largest fp32 error seen on any kernel variant, >= 7x over
the reported AVX-512 difference. On the built-in models (hidden 256, 8 layers) transformers'
fp32 is within 3e-6 relative of float64, and ours within 2% of the tolerance of it. A
fixed ``atol = 1e-4`` (6e-6 .. 1.2e-5 relative to these rows) would leave no room for the scalar-kernel
error (2.65e-5 relative, 2.7e-4 absolute) in either of the two runs compared.

Not vacuous: what real bugs do (relative to max|row|; tests/models/test_parity.py
``test_tolerance_catches_small_bugs`` replays them on every test checkpoint)
--------------------------------------------------------------------------------------------
* caches (KV and GDN states) rounded to bf16 once: 7.8e-4 .. 3.4e-3 (the subtlest: >= ~7x over),
* one decode step at position p+1, or a prefill chunk's positions off by one: 3.6e-3 .. 4.5e-2,
* a prompt token dropped 140 tokens before the compared rows: 7.4e-3 .. 3.5e-2,
* a GDN state that replays one token (off-by-one state): 0.3 .. 1.3,
* every norm's eps 10x: 0.1 .. 0.2 on the hybrids, but 1.3e-5 on the dense model -- below fp32
  noise, where no logits comparison can see it (config parsing tests must).

Greedy tokens
-------------
Within the tolerance, the argmax is fixed wherever the expected row's top-1/top-2 gap exceeds
twice the tolerance (:func:`greedy_determined`); in rows with a nearer tie the greedy token is
decided by rounding and may differ between CPUs (the random-token prompts of
tests/models/test_parity.py contain a row with gap 1.1e-5 * max|row| ~ 1e-4). So
:func:`assert_logits_close` does not compare argmaxes separately: where they are determined the
element bound already implies them, elsewhere a comparison would be a coin toss. Tests that
compare generated tokens stay exact; the rows deciding them were measured against float64
logits: the closest is 2.6x the tolerance (tests/engine/test_parity.py, 64-token prompt; gap
3.9e-3), all others >= 9x; tests/models/test_builtin.py asserts this for its generation.

Single kernel ops (tests/kernels/test_gdn.py, test_attention.py, test_conv1d.py) are compared
with float64 references under their own elementwise ``atol + rtol * |expected|``: those outputs are
not logits, and on every variant above they use <= 10% of it, so they keep their bounds.

A bfloat16 recurrent state (``model.ssm_state_dtype``; ``BF16_STATE``: ``atol = rtol = 1e-2``)
rounds the state wherever one is stored: between prefill chunks, after each decode step, at a
capture. Against a float32 state, the tiny model's logits (a 350-token prompt chunked at 256,
then 4 decode steps) differ by 0.32 of the tolerance, growing with every decode step (6.8e-3
relative after 24; greedy tokens part before the 32nd); the "rounded to bf16 once" bug above
sits at this size, so no tolerance could tell it from a bfloat16 state. A hit that restores a bfloat16 checkpoint against
a cold run chunked at the same point: 2.5e-4 relative (0.023 of the tolerance; not zero, as a
capture and a final state are two float32 paths whose last bits can round apart).

GPU (tests/engine/test_gpu_parity.py, Triton vs reference ops, both on the GPU): ``GPU_FP32``
(``1e-3, 1e-3``) and ``GPU_BF16`` (``0.25, 0.02``) are the values that test used before, now under
the same per-row rule (equal to the old elementwise bound at each row's largest logits, looser for
the small ones). They were not re-measured here (no CUDA device on this machine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7


@dataclass(frozen=True)
class LogitTolerance:
    """``|actual - expected| <= atol + rtol * max|expected row|`` elementwise (module docstring)."""

    atol: float
    rtol: float

    def bound(self, expected: torch.Tensor) -> torch.Tensor:
        """Allowed |difference| per row of ``expected`` (``[..., vocab]``), shape ``[..., 1]``."""
        return self.atol + self.rtol * expected.double().abs().amax(-1, keepdim=True)


CPU_FP32 = LogitTolerance(atol=1e-4, rtol=1e-4)
GPU_FP32 = LogitTolerance(atol=1e-3, rtol=1e-3)
GPU_BF16 = LogitTolerance(atol=0.25, rtol=0.02)
#: a bfloat16 recurrent state (``model.ssm_state_dtype``) against a float32 one, or against
#: itself stored at other points (see the docstring)
BF16_STATE = LogitTolerance(atol=1e-2, rtol=1e-2)


def tolerance_used(actual: torch.Tensor, expected: torch.Tensor, tol: LogitTolerance = CPU_FP32) -> float:
    """``max |actual - expected| / bound``: <= 1 passes; ``inf`` if anything is not finite."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}"
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    return ((a - e).abs() / tol.bound(e)).max().item() if a.numel() else 0.0


def assert_logits_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, tol: LogitTolerance = CPU_FP32
) -> float:
    """Assert ``actual`` logits are within ``tol`` of ``expected`` (``[rows, vocab]`` or ``[vocab]``).

    Returns the fraction of the tolerance used (the worst element's ``|diff| / bound``).
    """
    used = tolerance_used(actual, expected, tol)
    if not used <= 1.0:
        a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
        if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
            bad = (~torch.isfinite(a) | ~torch.isfinite(e)).reshape(-1, a.shape[-1]).any(-1)
            raise AssertionError(f"{what}: non-finite logits in rows {bad.nonzero().flatten().tolist()}")
        diff = (a - e).abs()
        bound = tol.bound(e).expand_as(diff)
        flat = int((diff / bound).flatten().argmax())
        col = flat % diff.shape[-1]
        row = flat // diff.shape[-1]
        bad_rows = int((diff > bound).reshape(-1, diff.shape[-1]).any(-1).sum())
        raise AssertionError(
            f"{what}: |logit diff| {diff.flatten()[flat].item():.3g} at row {row} col {col} exceeds "
            f"{bound.flatten()[flat].item():.3g} = {tol.atol:g} + {tol.rtol:g} * max|expected row| "
            f"({used:.3g}x the tolerance; {bad_rows} of {diff.numel() // diff.shape[-1]} rows out)"
        )
    return used


def greedy_gap_ratio(expected: torch.Tensor, tol: LogitTolerance = CPU_FP32) -> torch.Tensor:
    """Per row of ``expected``: its top-1/top-2 gap in units of the row's bound."""
    e = expected.detach().double().cpu()
    top2 = e.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]) / tol.bound(e)[..., 0]


def greedy_determined(expected: torch.Tensor, tol: LogitTolerance = CPU_FP32) -> torch.Tensor:
    """Per row: gap > 2 * bound, so every result within ``tol`` of ``expected`` has its argmax."""
    return greedy_gap_ratio(expected, tol) > 2


def assert_greedy_runs_agree(
    got: list[torch.Tensor], want: list[torch.Tensor], label: str, tol: LogitTolerance, ties_may_flip: bool
) -> bool:
    """Two greedy runs over the same requests, as the logits each recorded per step: every step's
    logits within ``tol`` up to the first greedy pick that differs. Within ``tol`` a pick can
    differ only in a row whose top-two gap ``tol`` does not determine (``greedy_determined``:
    the element bound implies every determined argmax), so a flip is a near-tie; it is allowed
    when ``ties_may_flip``, and the runs then continue different texts, so the comparison ends
    there. Returns whether a pick flipped (the caller compares tokens only when none did)."""
    for step, (g, w) in enumerate(zip(got, want, strict=False)):
        assert_logits_close(g, w, f"{label} step {step}", tol)
        flipped = (g.argmax(-1) != w.argmax(-1)).nonzero().flatten()
        if flipped.numel():
            assert ties_may_flip, f"{label} step {step}: greedy picks flip in rows {flipped.tolist()}"
            return True
    assert len(got) == len(want), f"{label}: {len(got)} steps against {len(want)}"
    return False
