"""IncrementalDetokenizer: the byte-table fast path and the sliding-window fallback both give
transformers' ``decode`` of the whole sequence, and stop strings cut where they first occur."""

from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from deltaserve.engine.front.detokenizer import IncrementalDetokenizer, token_byte_table
from deltaserve.models import ensure_builtin_model

TEXTS = [
    "Hello, world! The cat reads a story.",
    "naïve café — 北京欢迎你 🙂🙃 ok",
    "tabs\tand\nnewlines\r\n  spaces",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(ensure_builtin_model("tiny-qwen3.5"))


def sequences(tokenizer: Any) -> list[list[int]]:
    rng = random.Random(0)
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    n = len(tokenizer)
    seqs += [[rng.randrange(n) for _ in range(rng.randint(1, 40))] for _ in range(60)]  # any bytes, any order
    return seqs


def run(det: IncrementalDetokenizer, ids: list[int], chunk: int) -> str:
    out = [det.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return "".join(out) + det.flush()


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_matches_whole_sequence_decode(tokenizer: Any, fast: bool, chunk: int) -> None:
    assert token_byte_table(tokenizer) is not None  # the builtin tokenizer is byte-level
    for ids in sequences(tokenizer):
        det = IncrementalDetokenizer(tokenizer, [])
        if not fast:
            det._table = None
        want = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        got = run(det, ids, chunk)
        # an incomplete UTF-8 character at the very end is held back, never released as U+FFFD
        assert got == want or (want.endswith("\ufffd") and want.startswith(got)), (ids, got, want)


@pytest.mark.parametrize("fast", [True, False])
def test_stop_strings_cut_at_the_first_occurrence(tokenizer: Any, fast: bool) -> None:
    text = "alpha beta gamma delta beta epsilon"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop, want in [
        (["beta"], "alpha "),
        (["gamma d", "epsilon"], "alpha beta "),
        (["zeta"], text),
        (["a b"], "alph"),
        (["n"], "alpha beta gamma delta beta epsilo"),
    ]:
        for chunk in (1, 2, 5):
            det = IncrementalDetokenizer(tokenizer, stop)
            if not fast:
                det._table = None
            deltas = [det.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
            got = "".join(deltas) + det.flush()
            assert got == want, (stop, chunk, got)
            assert det.stopped == (want != text)
            # nothing past the stop, and no stop string, is ever released
            assert not any(s in "".join(deltas) for s in stop)
