"""The runner's packed host buffer (fields by name) and its vector placeholder helper."""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.engine.runner.batch_buffer import BatchBuffer
from deltaserve.engine.runner.batch_layout import take_placeholders as _take_placeholders
from deltaserve.scheduler.request import is_placeholder, placeholder, placeholder_row


def test_fields_by_name_round_trip() -> None:
    fields = {
        "a": np.arange(3, dtype=np.int64),
        "empty": np.zeros(0, dtype=np.int64),
        "b": np.array([7, 8], dtype=np.int64),
    }
    buf = BatchBuffer.pack(fields)
    assert buf.host.dtype == torch.int64 and buf.host.tolist() == [0, 1, 2, 7, 8]
    for name, array in fields.items():
        assert buf.field(name).tolist() == array.tolist()
    copy = buf.host.clone()  # a device copy is sliced the same way
    views = buf.views(copy)
    assert list(views) == list(fields)
    assert {k: v.tolist() for k, v in views.items()} == {k: v.tolist() for k, v in fields.items()}
    views["b"][0] = 9  # views, not copies
    assert copy.tolist() == [0, 1, 2, 9, 8]


def test_take_placeholders_matches_the_scalar_helpers() -> None:
    ids = [5, placeholder(0), 3, placeholder(7), 0, placeholder(2)]
    input_ids = np.array(ids, dtype=np.int64)
    dst, src = _take_placeholders(input_ids)
    assert dst.tolist() == [i for i, t in enumerate(ids) if is_placeholder(t)]
    assert src.tolist() == [placeholder_row(t) for t in ids if is_placeholder(t)]
    assert input_ids.tolist() == [0 if is_placeholder(t) else t for t in ids]  # filled in on the device
    none_dst, none_src = _take_placeholders(np.array([1, 2], dtype=np.int64))
    assert len(none_dst) == len(none_src) == 0
