"""A request is validated once, at the front door: ``SamplingParams`` checked once for ``n``
completions (the model's defaults and each completion's ``n=1, seed+i`` copy are built from
validated parameters; the core decodes them trusted), the waiting queue checked once per request
(by the front end: the core does not check again), over the default ``serve`` placement (a
separate core process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams, sampling_params
from tests.engine.conftest import separate
from tests.engine.validation_hooks import COUNT_ENV, counting_rules

pytestmark = pytest.mark.asyncio


async def test_n_completions_are_validated_once_over_a_core_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    counts = tmp_path / "core-counts"
    counts.touch()
    monkeypatch.setenv("DELTASERVE_CORE_HOOK", "tests.engine.validation_hooks:count_in_core")
    monkeypatch.setenv(COUNT_ENV, str(counts))
    config = separate(EngineConfig.load(None, {"model.path": "builtin:tiny-qwen3.5"}))
    async with AsyncEngine(config) as engine:
        front: list[str] = []
        monkeypatch.setattr(sampling_params, "_RULES", counting_rules(front))
        capacity = 0
        real = engine.client.check_capacity

        def check_capacity(n: int) -> None:
            nonlocal capacity
            capacity += 1
            real(n)

        monkeypatch.setattr(engine.client, "check_capacity", check_capacity)
        params = SamplingParams(n=3, seed=5, max_tokens=4, temperature=0.8, ignore_eos=True)
        assert front == ["params"]  # constructing it: the one validation
        outs = [o async for o in engine.generate("Hello there", params)]
        assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
        assert all(o.finish_reason == "length" for o in outs if o.finished)
        assert front == ["params"] and capacity == 1
        await engine.check_integrity()  # after every add has been applied in the core
    assert counts.read_text() == ""  # the core process validated nothing and checked no queue
