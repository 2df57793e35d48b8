"""The front end <-> core messages survive msgpack both ways, field for field; a core's
``TokenDelta`` carries token ids, never text (the front end makes the text)."""

from __future__ import annotations

import msgspec

from deltaserve.engine.core.ipc_files import pid_alive
from deltaserve.engine.front.client import ModelInfo
from deltaserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CheckIntegrity,
    CoreMessage,
    FrontMessage,
    GetStats,
    Hello,
    IntegrityChecked,
    Ready,
    Shutdown,
    StepOutputs,
    TokenDelta,
)
from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.sampling_params import SamplingParams


def test_front_messages_round_trip() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, stop=["x"], seed=3, logprobs=2)
    msgs = [
        Hello(123, True),
        AddRequest("a:1", [1, 2, 3], params, priority=-4, cache_salt=b"\x00salt", arrival_time=12.5),
        AbortRequests(["a:1", "a:2"]),
        GetStats(),
        Shutdown(),
        CheckIntegrity(9),
    ]
    dec = msgspec.msgpack.Decoder(FrontMessage)
    for m in msgs:
        assert dec.decode(msgspec.msgpack.encode(m)) == m


def test_core_messages_round_trip() -> None:
    lp = TokenLogprob(5, -0.25, 1, [(5, -0.25), (9, -2.0)])
    step = StepOutputs(
        [TokenDelta("a:1", [5], logprobs=[lp]), TokenDelta("a:2", [], finish_reason="error", error="boom")],
        {"scheduler.running": 1, "time": 1.5},
    )
    info = ModelInfo(
        name="m", model_type="t", max_model_len=64, vocab_size=100, block_size=16, checkpoint_unit=64
    )
    ready = Ready(info, ["p", "float32", ""], 12, 77, {"x": 1})
    dec = msgspec.msgpack.Decoder(CoreMessage)
    assert dec.decode(msgspec.msgpack.encode(step)) == step
    assert dec.decode(msgspec.msgpack.encode(ready)) == ready
    for checked in (IntegrityChecked(9), IntegrityChecked(10, "block 3 is free and in use")):
        assert dec.decode(msgspec.msgpack.encode(checked)) == checked


def test_a_delta_is_finished_by_its_reason_and_ready_carries_the_defaults() -> None:
    assert not TokenDelta("a", [1]).finished
    assert TokenDelta("a", [], finish_reason="abort").finished
    info = ModelInfo(
        name="m", model_type="t", max_model_len=64, vocab_size=100, block_size=16, checkpoint_unit=64
    )
    ready = Ready(
        info,
        ["p"],
        12,
        77,
        {},
        sampling_defaults={"temperature": 0.6},
        sampling_source="file",
        chat_template="{{x}}",
    )
    back = msgspec.msgpack.Decoder(CoreMessage).decode(msgspec.msgpack.encode(ready))
    assert (back.sampling_defaults, back.sampling_source, back.chat_template) == (
        {"temperature": 0.6},
        "file",
        "{{x}}",
    )


def test_pid_alive() -> None:
    import os
    import subprocess
    import sys

    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid)
