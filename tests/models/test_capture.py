"""GDN state capture during prefill, and restore from the captured checkpoint.

A capture at a 64 boundary inside a prefill segment, copied into a fresh live slot
(``copy_state_slots``) and continued with the rest of the prompt (sharing the first
sequence's KV blocks, as a prefix-cache hit does), must give the logits of the uncaptured
run — which themselves match transformers (within tests/tolerances.py, as in test_parity).
"""

from __future__ import annotations

import torch

from tests.models.conftest import Env
from tests.models.driver import Capture, Work
from tests.models.test_parity import random_tokens
from tests.tolerances import assert_logits_close

PROMPT = 150
EXTRA = 3


def test_capture_then_restore_matches_uncaptured(hybrid_env: Env) -> None:
    env = hybrid_env
    runner = env.runner(state_fill=float("nan"), seed=11)
    tokens = random_tokens(PROMPT + EXTRA, seed=42)
    ref = env.reference(tokens)
    ck64, ck128, ck_end = runner.checkpoint_slots[:3]

    # Another sequence decodes in the same forward, so capture_seq is offset by num_decodes.
    other_tokens = random_tokens(12, seed=43)
    other = runner.add(other_tokens)
    runner.step([Work(other, 11)])

    source = runner.add(tokens)
    captures = [Capture(source, 64, ck64), Capture(source, 128, ck128)]
    out_other, out_src = runner.step([Work(other, 1), Work(source, PROMPT)], captures)
    assert_logits_close(out_src, ref[:PROMPT], f"{env.name} prefill with captures")
    assert_logits_close(out_other, env.reference(other_tokens)[11:12], f"{env.name} decode beside captures")

    # Capture at the end of a segment (capture_pos == segment length), in a chunked prefill.
    chunked = runner.add(tokens)
    runner.step([Work(chunked, 64)], [Capture(chunked, 64, ck_end)])

    for upto, slot in ((128, ck128), (64, ck64), (64, ck_end)):
        seq = runner.fork(source, upto, slot, tokens)
        pos = upto
        for piece in [PROMPT - upto, *[1] * EXTRA]:
            (out,) = runner.step([Work(seq, piece)])
            assert_logits_close(
                out, ref[pos : pos + piece], f"{env.name} restored at {upto} [{pos}, {pos + piece})"
            )
            pos += piece


def test_captured_state_equals_state_of_prefix_run(hybrid_env: Env) -> None:
    """The checkpoint at 128 holds exactly the live state after prefilling 128 tokens."""
    env = hybrid_env
    tokens = random_tokens(PROMPT, seed=5)
    a = env.runner(seed=1)
    ck = a.checkpoint_slots[0]
    seq_a = a.add(tokens)
    a.step([Work(seq_a, PROMPT)], [Capture(seq_a, 128, ck)])

    b = env.runner(seed=2)
    seq_b = b.add(tokens)
    b.step([Work(seq_b, 64)])
    b.step([Work(seq_b, 64)])
    for name, xs, ys in (
        ("conv", a.caches.conv_state, b.caches.conv_state),
        ("ssm", a.caches.ssm_state, b.caches.ssm_state),
    ):
        for j, (x, y) in enumerate(zip(xs, ys)):
            torch.testing.assert_close(
                x[ck], y[seq_b.slot], atol=1e-5, rtol=1e-5, msg=f"{name} state of GDN layer {j}"
            )
