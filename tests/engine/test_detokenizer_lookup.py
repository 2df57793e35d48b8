"""The detokenizer's one-token lookup (``token_text_table``) equals the incremental UTF-8
decoder on every step, also when tokens split a multi-byte character (the lookup is skipped
while the decoder holds a partial character, and for tokens whose bytes are not complete
UTF-8)."""

from __future__ import annotations

import codecs
import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from deltaserve.engine.front.detokenizer import IncrementalDetokenizer, token_byte_table, token_text_table
from deltaserve.models import ensure_builtin_model


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(ensure_builtin_model("tiny-qwen3.5"))


def test_lookup_equals_the_incremental_decoder_step_by_step(tokenizer: Any) -> None:
    table = token_byte_table(tokenizer)
    assert table is not None
    texts = token_text_table(tokenizer, table)
    partial = [i for i, t in enumerate(texts) if t is None]
    whole = [i for i, t in enumerate(texts) if t]
    assert partial, "the builtin vocabulary has tokens that are not complete UTF-8"
    # the bytes of multi-byte characters, token by token (split characters on purpose)
    split = tokenizer.encode("北京欢迎你 🙂🙃 naïve", add_special_tokens=False)
    rng = random.Random(4)
    seqs = [split] + [
        [rng.choice(partial if rng.random() < 0.4 else whole) for _ in range(rng.randint(1, 30))]
        for _ in range(300)
    ]
    for ids in seqs:
        det = IncrementalDetokenizer(tokenizer, [])
        reference = codecs.getincrementaldecoder("utf-8")("replace")
        for t in ids:
            assert det.add([t]) == reference.decode(table[t]), ids
        assert det.flush() == ""
