"""AsyncEngine over ProcCoreClient: the engine core in its own process gives what the in-process
core gives (tokens, text, stop strings, n > 1), and its faults stay where they belong (a killed core ends every
stream with an error; a killed front end leaves the core and the other front ends serving)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from deltaserve.engine import AsyncEngine, EngineConfig, EngineCore, SamplingParams
from deltaserve.engine.errors import EngineDeadError, InvalidRequestError
from deltaserve.engine.outputs import RequestOutput
from deltaserve.models import LoadedModel
from tests.engine.conftest import separate

pytestmark = pytest.mark.asyncio(loop_scope="module")

SETTINGS = {
    "scheduler.max_num_batched_tokens": 256,
    "scheduler.max_num_seqs": 8,
    "cache.memory_bytes": 64 * 1024**2,
    "logging.stats_interval_s": 60.0,
}
PROMPTS = ["Hello there", "The quick brown fox", "1 2 3 4 5"]


def proc_config() -> EngineConfig:
    return EngineConfig.load(None, dict(SETTINGS))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def proc() -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(separate(proc_config())) as client:
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local(tiny_loaded: LoadedModel) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(core=EngineCore(proc_config(), loaded=tiny_loaded)) as engine:
        yield engine


async def collect(stream: Any) -> list[RequestOutput]:
    return [o async for o in stream]


def joined(outs: list[RequestOutput], index: int = 0) -> tuple[list[int], str, str | None]:
    mine = [o for o in outs if o.index == index]
    return [t for o in mine for t in o.token_ids], "".join(o.text for o in mine), mine[-1].finish_reason


async def wait_idle(client: AsyncEngine, timeout: float = 20.0) -> dict[str, Any]:
    """Until the core reports nothing running or waiting (stats taken now); those stats."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        s = await client.fetch_stats()
        if s["scheduler.running"] == 0 and s["scheduler.waiting"] == 0:
            return s
        assert loop.time() < deadline, f"core not idle: {s}"
        await asyncio.sleep(0.02)


async def test_greedy_outputs_match_the_in_process_engine(proc: AsyncEngine, local: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    for prompt in PROMPTS:
        got = joined(await collect(proc.generate(prompt, params)))
        want = joined(await collect(local.generate(prompt, params)))
        assert got == want
        assert got[2] == "length" and len(got[0]) == 12


async def test_seeded_n_completions_match_the_in_process_engine(
    proc: AsyncEngine, local: AsyncEngine
) -> None:
    params = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=7, ignore_eos=True)
    got = await collect(proc.generate("Hello there", params))
    want = await collect(local.generate("Hello there", params))
    assert sorted(o.index for o in got if o.finished) == [0, 1, 2]
    for i in range(3):
        assert joined(got, i) == joined(want, i)
    assert {o.request_id for o in got} == {got[0].request_id}


async def test_a_stop_string_ends_the_request_in_the_front_end_and_the_core(
    proc: AsyncEngine, local: AsyncEngine
) -> None:
    free = joined(
        await collect(
            proc.generate("Hello there", SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))
        )
    )
    text = free[1]
    stop = text[6:8]  # a string the reply is known to contain, well after its start
    assert stop and stop in text
    before = (await wait_idle(proc))["requests.aborted"]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, stop=[stop])
    got = joined(await collect(proc.generate("Hello there", params)))
    want = joined(await collect(local.generate("Hello there", params)))
    assert got == want
    assert got[2] == "stop" and got[1] == text[: text.index(stop)] and stop not in got[1]
    after = await wait_idle(proc)
    # the front end told the core: it aborted the request instead of running it to max_tokens
    assert after["requests.aborted"] == before + 1
    assert after["scheduler.running"] == 0


async def test_leaving_a_stream_early_aborts_it_in_the_core(proc: AsyncEngine) -> None:
    before = (await wait_idle(proc))["requests.aborted"]
    stream = proc.generate("Hello there", SamplingParams(max_tokens=2000, ignore_eos=True))
    async for out in stream:
        assert out.finish_reason is None
        break
    stats = await wait_idle(proc)
    assert stats["requests.aborted"] == before + 1


async def test_abort_by_id_and_a_reused_id(proc: AsyncEngine) -> None:
    stream = proc.generate("Hello there", SamplingParams(max_tokens=2000, ignore_eos=True), request_id="r-1")
    with pytest.raises(InvalidRequestError, match="already in use"):
        proc.generate("Hello", SamplingParams(max_tokens=4), request_id="r-1")
    first = await stream.__anext__()
    assert first.finish_reason is None
    assert await proc.abort("r-1") is True
    rest = [o async for o in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert await proc.abort("r-1") is False
    again = await collect(
        proc.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), request_id="r-1")
    )
    assert again[-1].finish_reason == "length"


async def test_typed_errors_are_raised_at_the_call(proc: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError):
        proc.generate("Hello", SamplingParams(max_tokens=4), priority=2**40)
    with pytest.raises(InvalidRequestError):
        proc.generate([proc.model_info.vocab_size + 5], SamplingParams(max_tokens=4))


async def test_the_core_process_runs_no_detokenizer(proc: AsyncEngine) -> None:
    # the core's pid is another process, and its stats carry its own CPU time
    stats = proc.stats()
    assert stats["core.pid"] == proc.core_pid != os.getpid()
    assert stats["core.cpu_s"] > 0


async def test_a_killed_core_ends_every_stream_with_an_error() -> None:
    deaths: list[str] = []
    async with AsyncEngine(separate(proc_config())) as client:
        client.on_core_death.append(deaths.append)
        streams = [
            client.generate(p, SamplingParams(max_tokens=5000, ignore_eos=True))
            for p in ("Hello", "The quick")
        ]
        firsts = [await s.__anext__() for s in streams]
        assert all(not o.finished for o in firsts)
        assert client.core_pid is not None
        os.kill(client.core_pid, signal.SIGKILL)
        for s in streams:
            rest = await asyncio.wait_for(collect(s), timeout=10)
            assert rest[-1].finished and rest[-1].finish_reason == "error"
            assert "engine core process" in (rest[-1].error or "") and "died" in (rest[-1].error or "")
        assert not client.is_healthy()
        assert len(deaths) == 1
        with pytest.raises(EngineDeadError, match="died"):
            client.generate("Hello", SamplingParams(max_tokens=4))


FRONT_END = textwrap.dedent(
    """
    import asyncio, sys
    from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams

    async def main():
        client = AsyncEngine(EngineConfig.load(None, {}), address=sys.argv[1])
        await client.start()
        stream = client.generate("Hello", SamplingParams(max_tokens=100000, ignore_eos=True))
        await stream.__anext__()
        print("streaming", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_a_dead_front_end_does_not_stop_the_core_or_the_other_front_end() -> None:
    from deltaserve.engine.core.core_proc import start_core

    handle = start_core(proc_config())
    other = subprocess.Popen(
        [sys.executable, "-c", FRONT_END, handle.address], stdout=subprocess.PIPE, text=True
    )
    try:
        async with AsyncEngine(proc_config(), address=handle.address) as client:
            assert other.stdout is not None
            line = await asyncio.get_running_loop().run_in_executor(None, other.stdout.readline)
            assert line.strip() == "streaming"
            assert client.stats()["scheduler.running"] >= 0
            mine = client.generate("The quick", SamplingParams(max_tokens=400, ignore_eos=True))
            await mine.__anext__()
            other.kill()
            other.wait()
            out = await asyncio.wait_for(collect(mine), timeout=60)
            assert out[-1].finish_reason == "length"  # ran to its end beside the dead front end's
            stats = await wait_idle(client)  # the dead front end's request was aborted by the core
            assert stats["requests.aborted"] == 1 and stats["requests.finished"] == 1
            assert handle.alive()
    finally:
        other.kill()
        handle.kill()
        handle.join(10)


async def test_a_burst_on_the_idle_core_is_admitted_together(local: AsyncEngine) -> None:
    """The core process's loop waits the burst window before its first step after idle: three
    prompts on one new 300-token prefix sent 50 ms apart resume from the first one's branch
    checkpoint at 288 (and decode what the in-process engine decodes)."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(40)] for _ in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    settings = {**SETTINGS, "scheduler.burst_window_ms": 1000, "scheduler.max_num_batched_tokens": 512}
    async with AsyncEngine(separate(EngineConfig.load(None, settings))) as client:

        async def later(i: int) -> list[RequestOutput]:
            await asyncio.sleep(0.05 * i)
            return await collect(client.generate(prompts[i], params))

        outs = await asyncio.gather(*(later(i) for i in range(3)))
    assert [o[-1].num_cached_tokens for o in outs] == [0, 288, 288]
    for p, o in zip(prompts, outs, strict=True):
        assert joined(o)[0] == joined(await collect(local.generate(p, params)))[0]
