"""The EngineClient seam: AsyncEngine implements it; an InputProcessor works alone (no model),
refusing what the engine refuses and building the requests the engine builds."""

from __future__ import annotations

from typing import Any

import pytest

from deltaserve.cache.hashing import make_salt
from deltaserve.engine import (
    AsyncEngine,
    EngineClient,
    InputProcessor,
    InvalidRequestError,
    PromptTooLongError,
    RequestInput,
    SamplingParams,
)
from tests.engine.conftest import greedy


async def test_async_engine_is_an_engine_client(core_factory: Any) -> None:
    core = core_factory()
    engine = AsyncEngine(core=core)
    assert isinstance(engine, EngineClient) and not engine.started
    async with engine:
        assert engine.started and engine.is_healthy()
        assert engine.input_processor is core.input_processor and engine.tokenizer is core.tokenizer
        info = engine.model_info
        assert (info.max_model_len, info.vocab_size, info.checkpoint_unit) == (
            core.max_model_len,
            core.vocab_size,
            core.cache.unit,
        )
        assert info.block_size == core.config.cache.block_size and info.capacity == core.capacity.describe()
        via_generate = [o async for o in engine.generate([5, 6, 7, 8], greedy(3), request_id="a")]
        via_submit = [
            o async for o in engine.submit(RequestInput(prompt=[5, 6, 7, 8], sampling_params=greedy(3)))
        ]
        assert [o.token_ids for o in via_generate] == [o.token_ids for o in via_submit]
        assert not await engine.abort("a")  # finished: nothing to abort
    assert not engine.started


def test_input_processor_alone_matches_the_engine(core_factory: Any) -> None:
    core = core_factory()
    proc = InputProcessor(
        core.tokenizer,
        max_model_len=64,
        vocab_size=core.vocab_size,
        salt_parts=core.input_processor.salt_parts,
    )
    req = proc.process(RequestInput(prompt="hello there", cache_salt="t", priority=3))
    twin = core.make_request("hello there", cache_salt="t", priority=3)
    assert req.prompt_token_ids == twin.prompt_token_ids and req.cache_salt == twin.cache_salt
    assert req.cache_salt == make_salt(*core.input_processor.salt_parts, "t") and req.priority == 3
    assert req.request_id != proc.process(RequestInput(prompt="hello there")).request_id
    with pytest.raises(PromptTooLongError):
        proc.process(RequestInput(prompt=[3] * 64))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        proc.process(RequestInput(prompt=[core.vocab_size]))
    with pytest.raises(InvalidRequestError, match="chat messages only"):
        proc.process(RequestInput(prompt="x", tools=[]))
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        proc.process(RequestInput(prompt="x", sampling_params={"max_tokens": 1}))  # type: ignore[arg-type]
    # ids are the engine's state: the processor alone does not check them, the engine does
    proc.process(RequestInput(prompt="x", request_id="same"))
    core.add_request(core.make_request("x", SamplingParams(max_tokens=1), request_id="same"))
    with pytest.raises(InvalidRequestError, match="already in use"):
        core.make_request("x", request_id="same")
