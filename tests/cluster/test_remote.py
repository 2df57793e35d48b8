"""The ingress's core client over a scripted fake handle (``RayCoreClient`` under an
``AsyncEngine``): validation and tokenization at the ingress, route hints, text made at the
ingress from the replica's token deltas, retries of requests whose replica died before any
output, errors (never silence) after output or on a refusal, cancellation. Needs Ray's
exception types only."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'deltaserve[cluster]'")

from ray import exceptions as rx  # noqa: E402

from deltaserve.cluster.affinity import route_keys  # noqa: E402
from deltaserve.cluster.ray_core import RayCoreClient, is_replica_failure  # noqa: E402
from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from deltaserve.engine.errors import EngineOverloadedError, InvalidRequestError  # noqa: E402
from deltaserve.engine.front.client import RequestInput  # noqa: E402
from deltaserve.engine.messages import AddRequest, TokenDelta  # noqa: E402
from deltaserve.engine.outputs import RequestOutput  # noqa: E402

MODEL = "builtin:tiny-qwen3.5"
INFO = {
    "replica": "r0", "name": MODEL, "model_type": "qwen3_5_text", "salt_parts": ["/m", "auto", "default"],
    "block_size": 16, "checkpoint_unit": 64, "has_gdn": True, "max_model_len": 2048, "vocab_size": 1024,
    "max_token_chars": 32, "capacity": {"num_kv_blocks": 100},
}  # fmt: skip


def d(tokens: list[int], finished: bool = False) -> tuple[list[int], bool]:
    """A scripted delta of the call's request: its tokens, and whether it is the last."""
    return tokens, finished


class FakeCall:
    """One streaming ``generate`` call: scripted items; a ``d(...)`` becomes the msgpack list of
    one ``TokenDelta`` of the call's request, as a replica sends it."""

    def __init__(self, payload: bytes, items: list[Any]) -> None:
        self.add = msgspec.msgpack.decode(payload, type=AddRequest)
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        x = self.items.pop(0)
        if isinstance(x, asyncio.Event):  # the replica is slow: the call waits here
            await x.wait()
            x = self.items.pop(0)
        if isinstance(x, BaseException):
            raise x
        if isinstance(x, tuple):
            tokens, last = x
            delta = TokenDelta(self.add.request_id, tokens, finish_reason="length" if last else None)
            return msgspec.msgpack.encode([delta])
        return x

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """``handle.options(stream=True).generate.remote(...)``: one scripted call per script;
    ``handle.describe.remote()``: ``INFO``."""

    deployment_name = "EngineReplica"

    def __init__(self, *scripts: list[Any]) -> None:
        self.scripts = list(scripts)
        self.calls: list[tuple[FakeCall, dict[str, Any]]] = []

    def options(self, **kw: Any) -> FakeHandle:
        return self

    @property
    def generate(self) -> FakeHandle:
        return self

    @property
    def describe(self) -> Any:
        class Describe:
            async def remote(self) -> dict[str, Any]:
                return dict(INFO)

        return Describe()

    def remote(self, payload: bytes, **kwargs: Any) -> FakeCall:
        call = FakeCall(payload, self.scripts.pop(0))
        self.calls.append((call, kwargs))
        return call


async def engine(*scripts: list[Any]) -> tuple[AsyncEngine, RayCoreClient, FakeHandle]:
    handle = FakeHandle(*scripts)
    config = EngineConfig.load(None, {"model.path": MODEL})
    client = RayCoreClient(handle, config, max_retries=2)
    eng = await AsyncEngine(config, client=client).start()
    return eng, client, handle


async def collect(stream: Any) -> list[RequestOutput]:
    return [o async for o in stream]


PROMPT = [(5 * i + 1) % 1000 + 3 for i in range(200)]
ACCEPT = {"accepted": "r1", "request_id": "q"}


async def test_stream_hint_route_and_text_at_the_ingress() -> None:
    eng, client, handle = await engine([{"accepted": "r1", "request_id": "x"}, d([1, 2]), d([3], True)])
    s = eng.generate(PROMPT, SamplingParams(max_tokens=3), request_id="q1", cache_salt="t")
    outs = await collect(s)
    assert [o.token_ids for o in outs] == [[1, 2], [3]] and outs[-1].finished and s.finished
    assert "".join(o.text for o in outs) == eng.tokenizer.decode([1, 2, 3], skip_special_tokens=True)
    call, kwargs = handle.calls[0]
    assert call.add.prompt_token_ids == PROMPT and call.add.sampling_params.max_tokens == 3
    hint = kwargs["route"]
    salt = eng.input_processor.process(RequestInput(prompt=PROMPT, cache_salt="t")).cache_salt
    assert call.add.cache_salt == salt
    assert list(hint.keys) == route_keys(PROMPT, block_size=16, unit=64, salt=salt) and hint.num_tokens == 200
    assert client.routes["q1"] == {"replica": "r1", "attempt": 1} and not client._calls
    await eng.shutdown()


async def test_chat_is_tokenized_once_at_the_ingress() -> None:
    eng, _, handle = await engine([ACCEPT, d([1], True)])
    msgs = [{"role": "user", "content": "hello there"}]
    await collect(eng.generate(msgs, SamplingParams(max_tokens=1)))
    tok = eng.tokenizer
    sent = handle.calls[0][0].add.prompt_token_ids
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert sent == list(tok.encode(rendered, add_special_tokens=False))
    await eng.shutdown()


async def test_bad_input_is_refused_before_any_call() -> None:
    eng, _, handle = await engine()
    with pytest.raises(InvalidRequestError):
        eng.generate([5000], SamplingParams(max_tokens=1))  # outside the vocabulary
    with pytest.raises(InvalidRequestError):
        eng.generate(PROMPT, SamplingParams(max_tokens=1), priority=2**40)
    with pytest.raises(Exception, match="max_model_len"):
        eng.generate([3] * 3000, SamplingParams(max_tokens=1))
    assert handle.calls == []
    await eng.shutdown()


@pytest.mark.parametrize("when", ["before-accept", "after-accept"])
async def test_a_replica_that_dies_before_output_is_retried_elsewhere(when: str) -> None:
    first = [rx.ActorDiedError()] if when == "before-accept" else [ACCEPT, rx.ActorDiedError()]
    eng, client, handle = await engine(first, [{"accepted": "r2", "request_id": "q"}, d([7], True)])
    outs = await collect(eng.generate(PROMPT, SamplingParams(max_tokens=1), request_id="q"))
    assert [o.token_ids for o in outs] == [[7]] and outs[0].finish_reason == "length"
    assert (
        len(handle.calls) == 2 and client.counters["retries"] == 1 and client.routes["q"]["replica"] == "r2"
    )
    await eng.shutdown()


async def test_a_replica_that_dies_after_output_ends_the_request_with_an_error() -> None:
    # n = 2: completion 0 alone until its first delta, then completion 1 (one call each)
    eng, client, _ = await engine(
        [ACCEPT, d([1]), rx.ActorDiedError()], [ACCEPT, d([2]), rx.ActorDiedError()]
    )
    outs = await collect(eng.generate(PROMPT, SamplingParams(max_tokens=4, n=2), request_id="q"))
    ends = [o for o in outs if o.finished]
    assert sorted(o.index for o in ends) == [0, 1]  # every completion ends, none silently
    assert all(o.finish_reason == "error" and "replica r1 failed" in (o.error or "") for o in ends)
    assert client.counters["failed"] == 2 and client.counters["retries"] == 0
    await eng.shutdown()


async def test_retries_are_bounded() -> None:
    eng, _, handle = await engine([rx.ActorDiedError()], [rx.ActorDiedError()], [rx.ActorDiedError()])
    outs = await collect(eng.generate(PROMPT, SamplingParams(max_tokens=1)))
    assert len(handle.calls) == 3 and outs[-1].finish_reason == "error"
    await eng.shutdown()


async def test_a_refusal_and_an_early_end_are_errors() -> None:
    try:
        raise EngineOverloadedError("waiting queue is full")
    except EngineOverloadedError as e:
        wrapped = rx.RayTaskError("generate", "traceback", e)
    eng, _, handle = await engine([wrapped], [ACCEPT, d([1])])
    outs = await collect(eng.generate(PROMPT, SamplingParams(max_tokens=1)))
    assert len(handle.calls) == 1  # a refusal is not retried
    assert outs[-1].finish_reason == "error" and "EngineOverloadedError: waiting queue is full" in (
        outs[-1].error or ""
    )
    outs = await collect(eng.generate(PROMPT, SamplingParams(max_tokens=4)))  # the stream just stops
    assert outs[-1].finish_reason == "error" and "ended the stream" in (outs[-1].error or "")
    assert is_replica_failure(rx.ActorDiedError()) and not is_replica_failure(wrapped)
    await eng.shutdown()


async def test_leaving_early_cancels_the_remote_call() -> None:
    eng, client, handle = await engine([ACCEPT, d([1]), asyncio.Event(), d([2]), d([3], True)])
    s = eng.generate(PROMPT, SamplingParams(max_tokens=3))
    async for _ in s:
        break  # the inner generator is finalised by the loop: that cancels the call
    for _ in range(10):
        await asyncio.sleep(0)
    assert handle.calls[0][0].cancelled and s.finished and not client._calls
    await eng.shutdown()
    assert not eng.is_healthy()


async def test_abort_ends_the_stream_with_abort_and_cancels_the_call() -> None:
    eng, client, handle = await engine(
        [ACCEPT, d([1]), asyncio.Event(), d([2])], [ACCEPT, d([5]), asyncio.Event(), d([6])]
    )
    assert eng.started and eng.model_info.checkpoint_unit == 64 and eng.core is None
    s = eng.generate(PROMPT, SamplingParams(max_tokens=4, n=2), request_id="q")
    first = await s.__anext__()
    assert await eng.abort("q") and not await eng.abort("other")
    outs = [first] + await collect(s)
    ends = [o for o in outs if o.finished]
    assert sorted(o.index for o in ends) == [0, 1] and all(o.finish_reason == "abort" for o in ends)
    for _ in range(10):
        await asyncio.sleep(0)
    assert all(call.cancelled for call, _ in handle.calls) and not client._calls
    await eng.shutdown()


async def test_core_ids_of_completions_never_sent_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``n > 1`` request aborted before its siblings were sent leaves their core ids behind
    (neither ended nor aborted in the core): the client keeps at most ``MAX_USERS`` of them,
    dropping the oldest, so a long-running ingress does not grow without bound."""
    import deltaserve.cluster.ray_core as ray_core

    monkeypatch.setattr(ray_core, "MAX_USERS", 5)
    eng, client, handle = await engine([ACCEPT, asyncio.Event(), d([1])], [ACCEPT, asyncio.Event(), d([1])])
    for rid in ("a", "b"):
        s = eng.generate(PROMPT, SamplingParams(max_tokens=4, n=3), request_id=rid)
        for _ in range(10):
            await asyncio.sleep(0)
        assert await eng.abort(rid)
        assert [o.finish_reason for o in await collect(s)] == ["abort"] * 3
    # completion 0 of each was sent and aborted (its entry left); 2 x 2 unsent siblings remain
    assert len(handle.calls) == 2 and len(client._users) == 4
    newest = client.core_ids("c", 3)
    assert len(client._users) == 5 and all(client._users[i] == "c" for i in newest)
    await eng.shutdown()
