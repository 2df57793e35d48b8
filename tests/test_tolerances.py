"""``assert_greedy_runs_agree`` (tests/tolerances.py), which the GPU parity test leans on: it
runs only on a CUDA device, so its rules are checked here on made-up logits."""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import GPU_BF16, assert_greedy_runs_agree

# bound per row: 0.25 + 0.02 * 10 = 0.45; a gap above 0.9 determines the pick
WIDE = torch.tensor([[10.0, 8.0, 0.0], [0.0, 10.0, 5.0]])  # gaps 2 and 5: determined
TIE = torch.tensor([[10.0, 9.8, 0.0], [0.0, 10.0, 5.0]])  # row 0's gap 0.2: a near-tie


def test_equal_runs_agree_without_a_flip() -> None:
    steps = [WIDE, WIDE + 0.1]
    assert (
        assert_greedy_runs_agree([s + 0.2 for s in steps], steps, "bf16", GPU_BF16, ties_may_flip=True)
        is False
    )


def test_a_flip_in_a_near_tie_row_ends_the_comparison() -> None:
    flipped = TIE.clone()
    flipped[0, :2] = torch.tensor([9.8, 10.0])  # within 0.45 of the reference, other pick
    # the steps after the flip may differ by anything: the texts parted
    got, want = [flipped, torch.zeros(2, 3)], [TIE, torch.full((2, 3), 100.0)]
    assert assert_greedy_runs_agree(got, want, "bf16", GPU_BF16, ties_may_flip=True) is True
    with pytest.raises(AssertionError, match=r"^fp32 step 0: greedy picks flip in rows \[0\]$"):
        assert_greedy_runs_agree(got, want, "fp32", GPU_BF16, ties_may_flip=False)


def test_a_determined_pick_cannot_flip_within_the_bound() -> None:
    # row 1's gap is 5 (> 2 x 0.45): to pick column 2 its logits must move past the bound
    flipped = WIDE.clone()
    flipped[1] = torch.tensor([0.0, 10.0, 10.5])
    with pytest.raises(AssertionError, match=r"bf16 step 0"):
        assert_greedy_runs_agree([flipped], [WIDE], "bf16", GPU_BF16, ties_may_flip=True)


def test_a_run_of_other_length_fails() -> None:
    with pytest.raises(AssertionError, match=r"^bf16: 1 steps against 2$"):
        assert_greedy_runs_agree([WIDE], [WIDE, WIDE], "bf16", GPU_BF16, ties_may_flip=True)


def test_logits_beyond_the_bound_fail_before_any_flip() -> None:
    with pytest.raises(AssertionError, match=r"bf16 step 1"):
        assert_greedy_runs_agree([WIDE, WIDE + 1.0], [WIDE, WIDE], "bf16", GPU_BF16, ties_may_flip=True)
