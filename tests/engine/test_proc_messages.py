"""The front end <-> core messages survive msgpack both ways, field for field; ``to_delta`` keeps
everything of a ``RequestOutput`` but its text (the front end makes the text)."""

from __future__ import annotations

import msgspec

from deltaserve.engine.core.core_proc import pid_alive, to_delta
from deltaserve.engine.front.client import ModelInfo
from deltaserve.engine.front.detokenizer import NoDetokenizer
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
from deltaserve.engine.outputs import RequestOutput, TokenLogprob
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


def test_to_delta_keeps_all_but_the_text() -> None:
    out = RequestOutput(
        request_id="a:1", token_ids=[4], text="ignored", finished=True, finish_reason="length",
        num_prompt_tokens=9, num_cached_tokens=64, queue_time_s=0.5, prefill_time_s=0.25,
        prompt_logprobs=[None, TokenLogprob(1, -1.0, 2)], prompt_token_ids=[0, 1],
    )  # fmt: skip
    d = to_delta(out)
    assert (d.request_id, d.token_ids, d.finish_reason) == ("a:1", [4], "length")
    assert (d.num_prompt_tokens, d.num_cached_tokens, d.queue_time_s, d.prefill_time_s) == (9, 64, 0.5, 0.25)
    assert d.prompt_logprobs == out.prompt_logprobs and d.prompt_token_ids == [0, 1]
    unfinished = to_delta(RequestOutput(request_id="b", token_ids=[1], text="t"))
    assert unfinished.finish_reason is None


def test_no_detokenizer_gives_no_text_and_never_stops() -> None:
    d = NoDetokenizer()
    assert d.add([1, 2, 3]) == "" and d.flush() == "" and d.stopped is False


def test_pid_alive() -> None:
    import os
    import subprocess
    import sys

    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid)
