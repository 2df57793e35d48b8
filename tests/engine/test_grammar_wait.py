"""Grammars never stall other requests: a schema past its limits is refused before anything
parses it; compiles run on the grammar workers (one per constraint however many ask), a
request whose grammar is compiling waits parked beside the scheduler while others step, and
one that outlives ``structured_outputs.compile_timeout_s`` ends with ``GrammarTimeoutError``.
A message decoded from a front end (``trusted_decode``) is not validated again."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from deltaserve.engine import (
    AsyncEngine,
    EngineCore,
    GrammarTimeoutError,
    InvalidRequestError,
    SamplingParams,
)
from deltaserve.engine.constraint import Constraint, ConstraintKind, SchemaLimits, trusted_decode
from deltaserve.engine.grammar import Grammars, wait_compiled
from deltaserve.engine.messages import AddRequest, FrontMessage
from tests.engine.conftest import greedy

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
})  # fmt: skip


def _schema(value: Any) -> Constraint:
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(value))


# ------------------------------------------------------------------ limits
def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: _schema({"type": "object", "properties": {f"p{i}": {} for i in range(10_000)}}),
            "an object of the JSON schema has 10000 properties; at most 1024",
        ),
        (lambda: _schema(_nested(200)), "the JSON schema nests deeper than 128 levels"),
        (
            lambda: Constraint(kind=ConstraintKind.JSON_SCHEMA, spec="[" * 50_000 + "]" * 50_000),
            "the JSON schema nests deeper than 128 levels",
        ),
        (
            lambda: _schema({"oneOf": [{"const": i} for i in range(300)]}),
            "a oneOf of the JSON schema has 300",
        ),
        (
            lambda: _schema({"enum": list(range(2000))}),
            "an enum of the JSON schema has 2000 values; at most 1024",
        ),
        (
            lambda: _schema({"type": "string", "enum": ["x" * 1000] * 200}),
            "the enum and const strings of the JSON schema exceed 131072 characters",
        ),
        (
            lambda: _schema({"properties": {f"p{i}": {"const": "y" * 1000} for i in range(200)}}),
            "the enum and const strings of the JSON schema exceed 131072 characters",
        ),
        (
            lambda: Constraint(kind=ConstraintKind.CHOICE, spec=["z" * 1000] * 200),
            "the choices hold 200000 characters; at most 131072",
        ),
    ],
)
def test_a_schema_past_a_limit_is_refused_before_it_is_parsed(
    make: Callable[[], Constraint], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import xgrammar

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("xgrammar was asked to parse a schema past the limits")

    for name in ("from_json_schema", "from_ebnf"):
        monkeypatch.setattr(xgrammar.Grammar, name, never)
    with pytest.raises(InvalidRequestError) as e:
        make()
    assert str(e.value).startswith(f"SamplingParams.constraint.spec: {message}")


def test_a_schema_at_the_limits_is_accepted() -> None:
    props = {f"p{i}": {"type": "integer"} for i in range(SchemaLimits.properties)}
    assert _schema({"type": "object", "properties": props}).kind is ConstraintKind.JSON_SCHEMA
    assert _schema(_nested(SchemaLimits.depth // 2 - 1)).spec


def test_a_trusted_decode_does_not_validate_again() -> None:
    with trusted_decode():  # as the core process receives what its front end sent
        bad = SamplingParams(max_tokens=0, constraint=Constraint(kind=ConstraintKind.REGEX, spec="a("))
    data = msgspec.msgpack.encode(AddRequest("r", [1, 2], bad))
    with pytest.raises(msgspec.ValidationError, match="invalid regex"):
        msgspec.msgpack.decode(data, type=FrontMessage)
    with trusted_decode():
        msg = msgspec.msgpack.decode(data, type=FrontMessage)
    assert isinstance(msg, AddRequest) and msg.sampling_params.max_tokens == 0
    with pytest.raises(InvalidRequestError, match="invalid regex"):
        Constraint(kind=ConstraintKind.REGEX, spec="a(")  # outside the block: checked again


# ------------------------------------------------------------------ the workers
@pytest.fixture
def gate() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # never leave a worker blocked


def gated(grammars: Grammars, gate: threading.Event) -> list[Constraint]:
    """Make ``grammars``'s compiles wait for ``gate``; the constraints compiled, in order."""
    compile_one = grammars._compile
    seen: list[Constraint] = []

    def slow(c: Constraint) -> Any:
        seen.append(c)
        assert gate.wait(30)
        return compile_one(c)

    grammars._compile = slow  # type: ignore[method-assign]
    return seen


def test_one_compile_per_constraint_however_many_ask(tiny_loaded: Any, gate: threading.Event) -> None:
    grammars = Grammars(tiny_loaded.tokenizer, 1024, tiny_loaded.eos_token_ids, threads=2)
    seen = gated(grammars, gate)
    c = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=SCHEMA)
    futures = [
        grammars.compile_async(Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=SCHEMA)) for _ in range(5)
    ]
    assert all(f is futures[0] for f in futures) and not futures[0].done()
    assert grammars.cached(c) is None and grammars.compiling == 1
    gate.set()
    compiled = futures[0].result(30)
    assert grammars.cached(c) is compiled and grammars.compile_async(c).result() is compiled
    assert len(seen) == 1 and grammars.compiles == 1 and grammars.compiling == 0


def test_a_compile_that_fails_is_an_invalid_request_and_is_not_cached(tiny_loaded: Any) -> None:
    grammars = Grammars(tiny_loaded.tokenizer, 1024, tiny_loaded.eos_token_ids)

    def broken(c: Constraint) -> Any:
        raise RuntimeError("native compiler says no")

    grammars._compile = broken  # type: ignore[method-assign]
    c = Constraint(kind=ConstraintKind.REGEX, spec="ab+")
    with pytest.raises(
        InvalidRequestError, match="^SamplingParams.constraint: did not compile: native compiler says no"
    ):
        grammars.compile_async(c).result(30)
    assert grammars.cached(c) is None and grammars.compile_errors == 1 and grammars.compiling == 0


async def test_the_wait_times_out_and_the_compile_goes_on_into_the_cache(
    tiny_loaded: Any, gate: threading.Event
) -> None:
    grammars = Grammars(tiny_loaded.tokenizer, 1024, tiny_loaded.eos_token_ids)
    gated(grammars, gate)
    c = Constraint(kind=ConstraintKind.REGEX, spec="[a-c]{3}")
    started = time.perf_counter()
    with pytest.raises(GrammarTimeoutError) as e:
        await wait_compiled(grammars.compile_async(c), 0.2)
    assert 0.2 <= time.perf_counter() - started < 5
    assert str(e.value) == (
        "SamplingParams.constraint: the output constraint did not compile within 0.2 s "
        "(structured_outputs.compile_timeout_s); a smaller schema compiles faster"
    )
    gate.set()
    await wait_compiled(grammars.compile_async(c), 30)  # the same compile, now done
    assert grammars.compiles == 1 and grammars.cached(c) is not None


# ------------------------------------------------------------------ the core parks
def _step_all(core: EngineCore, outs: dict[str, list[Any]]) -> None:
    for o in core.step():
        outs.setdefault(o.request_id, []).append(o)
    core.check_integrity()


def test_a_request_waits_parked_while_others_step_then_runs(
    core_factory: Callable[..., EngineCore], gate: threading.Event
) -> None:
    core = core_factory()
    seen = gated(core.grammars, gate)
    core.add_request(core.make_request([5, 6, 7], greedy(40), request_id="plain"))
    constrained = SamplingParams(max_tokens=60, temperature=0.0, constraint=Constraint(
        kind=ConstraintKind.JSON_SCHEMA, spec=SCHEMA))  # fmt: skip
    core.add_request(core.make_request([9, 10], constrained, request_id="json"))
    assert core.has_request("json") and "json" not in core.scheduler.requests
    assert core.stats()["grammar.parked"] == 1
    with pytest.raises(InvalidRequestError, match="already in use"):
        core.make_request([1], greedy(2), request_id="json")
    outs: dict[str, list[Any]] = {}
    for _ in range(10):  # the plain request streams while the grammar compiles
        _step_all(core, outs)
    assert len(outs["plain"]) == 10 and "json" not in outs and len(seen) == 1
    gate.set()
    for _ in range(500):
        if not core.has_work():
            break
        _step_all(core, outs)
    assert not core.has_work()
    text = core.tokenizer.decode([t for o in outs["json"] for t in o.token_ids], skip_special_tokens=True)
    assert outs["json"][-1].finish_reason in ("stop", "length")
    if outs["json"][-1].finish_reason == "stop":
        value = json.loads(text)
        assert set(value) == {"name", "n"}
    assert core.stats()["grammar.parked"] == 0


def test_a_parked_request_past_its_deadline_ends_with_the_timeout(
    core_factory: Callable[..., EngineCore], gate: threading.Event
) -> None:
    core = core_factory(**{"structured_outputs.compile_timeout_s": 0.2})
    gated(core.grammars, gate)
    params = SamplingParams(max_tokens=8, constraint=Constraint(kind=ConstraintKind.REGEX, spec="[xy]{4}"))
    core.add_request(core.make_request([3, 4], params, request_id="slow"))
    outs: dict[str, list[Any]] = {}
    deadline = time.monotonic() + 10
    while "slow" not in outs and time.monotonic() < deadline:
        _step_all(core, outs)
        time.sleep(0.02)
    (out,) = outs["slow"]
    assert out.finished and out.finish_reason == "error"
    assert out.error.startswith(
        "GrammarTimeoutError: SamplingParams.constraint: the output constraint did not compile within 0.2 s"
    )
    stats = core.stats()
    assert stats["grammar.timeouts"] == 1 and stats["requests.failed"] == 1 and not core.has_work()


def test_a_parked_request_aborts_and_shutdown_aborts_the_parked(
    core_factory: Callable[..., EngineCore], gate: threading.Event
) -> None:
    core = core_factory()
    gated(core.grammars, gate)
    params = SamplingParams(max_tokens=8, constraint=Constraint(kind=ConstraintKind.REGEX, spec="[ab]{4}"))
    core.add_request(core.make_request([3, 4], params, request_id="a"))
    core.add_request(core.make_request([3, 4], params, request_id="b"))
    out = core.abort_request("a")
    assert out is not None and out.finish_reason == "abort" and not core.has_request("a")
    (last,) = core.abort_all()
    assert last.request_id == "b" and last.finish_reason == "abort"
    assert not core.has_work()
    core.check_integrity()


async def test_the_event_loop_runs_on_while_a_grammar_compiles(
    core_factory: Callable[..., EngineCore], gate: threading.Event
) -> None:
    # the parked request's deadline runs while the plain one streams: 2 s leaves room for 12
    # tokens on a loaded 2-core box (0.3 s did not: the parked request timed out first)
    core = core_factory(**{"structured_outputs.compile_timeout_s": 2.0})
    gated(core.grammars, gate)
    c = Constraint(kind=ConstraintKind.REGEX, spec="[pq]{5}")
    async with AsyncEngine(core=core) as engine:
        with pytest.raises(GrammarTimeoutError, match="within 2 s"):
            await engine.compile_constraint(c)
        # a request submitted anyway waits parked; another streams meanwhile
        constrained = engine.generate([4, 5], SamplingParams(max_tokens=5, temperature=0.0, constraint=c))
        plain = [o async for o in engine.generate([6, 7], greedy(12))]
        assert len(plain) == 12 and plain[-1].finish_reason == "length"
        gate.set()
        outs = [o async for o in constrained]
        assert "".join(o.text for o in outs) in {"".join(p) for p in _words("pq", 5)}
        await engine.compile_constraint(c)  # cached now: at once


def _words(alphabet: str, n: int) -> Iterator[tuple[str, ...]]:
    import itertools

    return itertools.product(alphabet, repeat=n)


def test_the_process_exits_cleanly_while_a_grammar_compiles(tmp_path: Any) -> None:
    """A compile still running at interpreter exit is waited for: returning into a finalizing
    interpreter would abort the process (exit code 134, "terminate called ...")."""
    import subprocess
    import sys

    script = tmp_path / "exit_while_compiling.py"
    script.write_text(
        "import asyncio, json\n"
        "from deltaserve.engine import AsyncEngine, GrammarTimeoutError\n"
        "from deltaserve.engine.constraint import Constraint, ConstraintKind\n"
        "from tests.engine.conftest import make_config\n"
        "async def main():\n"
        "    props = {f'p{i}': {'type': 'string'} for i in range(1000)}\n"
        "    c = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps({'type': 'object', 'properties': props}))\n"
        "    async with AsyncEngine(make_config(**{'structured_outputs.compile_timeout_s': 0.05})) as engine:\n"
        "        try:\n"
        "            await engine.compile_constraint(c)\n"
        "        except GrammarTimeoutError:\n"
        "            print('timed out, still compiling', flush=True)\n"
        "asyncio.run(main())\n"
    )
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "timed out, still compiling" in done.stdout
