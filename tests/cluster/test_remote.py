"""The ingress's engine over a handle, with a scripted fake handle: validation and tokenization at
the ingress, route hints, retries of requests whose replica died before any output, errors (never
silence) after output, typed errors passed through, cancellation. Needs Ray's exception types only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'deltaserve[cluster]'")

from ray import exceptions as rx  # noqa: E402

from deltaserve.cluster.affinity import route_keys  # noqa: E402
from deltaserve.cluster.remote import RemoteEngine, is_replica_failure  # noqa: E402
from deltaserve.engine import EngineConfig, SamplingParams  # noqa: E402
from deltaserve.engine.errors import EngineOverloadedError, InvalidRequestError  # noqa: E402
from deltaserve.engine.front.client import RequestInput  # noqa: E402
from deltaserve.engine.outputs import RequestOutput  # noqa: E402
from deltaserve.models.tokenizer import load_tokenizer  # noqa: E402

INFO = {
    "replica": "r0", "name": "builtin:tiny-qwen3.5", "model_type": "qwen3_5_text", "salt_parts": ["/m", "auto", "default"],
    "block_size": 16, "checkpoint_unit": 64, "has_gdn": True, "max_model_len": 2048, "vocab_size": 1024,
    "max_token_chars": 32, "capacity": {"num_kv_blocks": 100},
}  # fmt: skip


class FakeCall:
    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        x = self.items.pop(0)
        if isinstance(x, BaseException):
            raise x
        return x

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """``handle.options(stream=True).generate.remote(...)``: one scripted call per script."""

    deployment_name = "EngineReplica"

    def __init__(self, *scripts: list[Any]) -> None:
        self.scripts = list(scripts)
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], FakeCall]] = []

    def options(self, **kw: Any) -> FakeHandle:
        return self

    @property
    def generate(self) -> FakeHandle:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> FakeCall:
        call = FakeCall(self.scripts.pop(0))
        self.calls.append((args, kwargs, call))
        return call


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("builtin:tiny-qwen3.5")


def engine(tokenizer: Any, *scripts: list[Any]) -> tuple[RemoteEngine, FakeHandle]:
    handle = FakeHandle(*scripts)
    eng = RemoteEngine(handle, EngineConfig(), max_retries=2)
    eng.prepare(INFO, tokenizer)
    return eng, handle


def out(tokens: list[int], finished: bool = False, index: int = 0) -> RequestOutput:
    return RequestOutput(
        request_id="x", token_ids=tokens, text="t" * len(tokens), finished=finished,
        finish_reason="length" if finished else None, index=index, num_prompt_tokens=200, num_cached_tokens=64,
    )  # fmt: skip


async def collect(stream: Any) -> list[RequestOutput]:
    return [o async for o in stream]


PROMPT = [(5 * i + 1) % 1000 + 3 for i in range(200)]


async def test_stream_hint_and_route(tokenizer: Any) -> None:
    eng, handle = engine(tokenizer, [{"accepted": "r1", "request_id": "q1"}, [out([1, 2])], [out([3], True)]])
    s = eng.generate(PROMPT, SamplingParams(max_tokens=3), request_id="q1", cache_salt="t")
    outs = await collect(s)
    assert [o.token_ids for o in outs] == [[1, 2], [3]] and outs[-1].finished and s.finished
    args, kwargs, _ = handle.calls[0]
    assert args[0] == PROMPT and kwargs["request_id"] == "q1" and kwargs["cache_salt"] == "t"
    hint = kwargs["route"]
    salt = eng.input_processor.process(RequestInput(prompt=PROMPT, cache_salt="t")).cache_salt
    assert list(hint.keys) == route_keys(PROMPT, block_size=16, unit=64, salt=salt) and hint.num_tokens == 200
    assert eng.routes["q1"] == {"replica": "r1", "attempt": 1} and not eng._streams


async def test_chat_is_tokenized_once_at_the_ingress(tokenizer: Any) -> None:
    eng, handle = engine(tokenizer, [{"accepted": "r1", "request_id": "c"}, [out([1], True)]])
    msgs = [{"role": "user", "content": "hello there"}]
    await collect(eng.generate(msgs, SamplingParams(max_tokens=1)))
    sent = handle.calls[0][0][0]
    assert sent == list(
        tokenizer.encode(
            tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
    )


async def test_bad_input_is_refused_before_any_call(tokenizer: Any) -> None:
    eng, handle = engine(tokenizer)
    with pytest.raises(InvalidRequestError):
        eng.generate([5000], SamplingParams(max_tokens=1))  # outside the vocabulary
    with pytest.raises(InvalidRequestError):
        eng.generate(PROMPT, SamplingParams(max_tokens=1), priority=2**40)
    with pytest.raises(Exception, match="max_model_len"):
        eng.generate([3] * 3000, SamplingParams(max_tokens=1))
    assert handle.calls == []


@pytest.mark.parametrize("when", ["before-accept", "after-accept"])
async def test_a_replica_that_dies_before_output_is_retried_elsewhere(tokenizer: Any, when: str) -> None:
    first = (
        [rx.ActorDiedError()]
        if when == "before-accept"
        else [{"accepted": "r1", "request_id": "q"}, rx.ActorDiedError()]
    )
    eng, handle = engine(tokenizer, first, [{"accepted": "r2", "request_id": "q"}, [out([7], True)]])
    s = eng.generate(PROMPT, SamplingParams(max_tokens=1), request_id="q")
    outs = await collect(s)
    assert [o.token_ids for o in outs] == [[7]] and outs[0].finish_reason == "length"
    assert len(handle.calls) == 2 and eng.counters["retries"] == 1 and eng.routes["q"]["replica"] == "r2"


async def test_a_replica_that_dies_after_output_ends_the_request_with_an_error(tokenizer: Any) -> None:
    eng, _ = engine(
        tokenizer, [{"accepted": "r1", "request_id": "q"}, [out([1]), out([2], index=1)], rx.ActorDiedError()]
    )
    s = eng.generate(PROMPT, SamplingParams(max_tokens=4, n=2), request_id="q")
    outs = await collect(s)
    ends = [o for o in outs if o.finished]
    assert sorted(o.index for o in ends) == [0, 1]  # every completion ends, none silently
    assert all(o.finish_reason == "error" and "replica r1 failed" in (o.error or "") for o in ends)
    assert eng.counters["failed"] == 1 and eng.counters["retries"] == 0


async def test_retries_are_bounded(tokenizer: Any) -> None:
    eng, handle = engine(tokenizer, [rx.ActorDiedError()], [rx.ActorDiedError()], [rx.ActorDiedError()])
    outs = await collect(eng.generate(PROMPT, SamplingParams(max_tokens=1)))
    assert len(handle.calls) == 3 and outs[-1].finish_reason == "error"


async def test_typed_rejections_pass_through_and_early_end_is_an_error(tokenizer: Any) -> None:
    try:
        raise EngineOverloadedError("waiting queue is full")
    except EngineOverloadedError as e:
        wrapped = rx.RayTaskError("generate", "traceback", e)
    eng, _ = engine(tokenizer, [wrapped], [{"accepted": "r1", "request_id": "q"}, [out([1])]])
    with pytest.raises(EngineOverloadedError):
        await collect(eng.generate(PROMPT, SamplingParams(max_tokens=1)))
    outs = await collect(eng.generate(PROMPT, SamplingParams(max_tokens=4)))  # the stream just stops
    assert outs[-1].finish_reason == "error" and "ended the stream" in (outs[-1].error or "")
    assert is_replica_failure(rx.ActorDiedError()) and not is_replica_failure(wrapped)


async def test_leaving_early_cancels_the_remote_call(tokenizer: Any) -> None:
    eng, handle = engine(
        tokenizer, [{"accepted": "r1", "request_id": "q"}, [out([1])], [out([2])], [out([3], True)]]
    )
    s = eng.generate(PROMPT, SamplingParams(max_tokens=3))
    async for _ in s:
        break  # the inner generator is finalised by the loop: that cancels the call
    for _ in range(10):
        await asyncio.sleep(0)
    assert handle.calls[0][2].cancelled and s.finished and not eng._streams
    await eng.shutdown()
    assert not eng.is_healthy()


async def test_abort_ends_the_stream_with_abort_and_cancels_the_call(tokenizer: Any) -> None:
    from deltaserve.engine.front.client import EngineClient

    assert isinstance(RemoteEngine(FakeHandle(), EngineConfig()), EngineClient)  # (not started)
    eng, handle = engine(tokenizer, [{"accepted": "r1", "request_id": "q"}, [out([1])], [out([2])]])
    assert isinstance(eng, EngineClient) and eng.started and eng.model_info.checkpoint_unit == 64
    s = eng.generate(PROMPT, SamplingParams(max_tokens=4, n=2), request_id="q")
    first = await s.__anext__()
    assert await eng.abort("q") and not await eng.abort("other")
    outs = [first] + await collect(s)
    ends = [o for o in outs if o.finished]
    assert sorted(o.index for o in ends) == [0, 1] and all(o.finish_reason == "abort" for o in ends)
    assert handle.calls[0][2].cancelled and s.finished and not eng._streams
