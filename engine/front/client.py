"""The EngineClient seam: what a front end (the OpenAI server) needs of an engine. Torch-free.

``AsyncEngine`` implements ``EngineClient`` in every placement of the engine core (this process,
a core process, the cluster's replicas: ``engine/front/core_client.py``); the server and
applications are typed against it only.

* ``RequestInput`` (``engine/front/input_processor.py``, re-exported here) holds one request's
  fields, written once; ``generate`` packs them and the implementation's ``submit`` takes them
  from there. No validation in the struct: the ``InputProcessor`` validates.
* ``ModelInfo`` describes the served model once the client has started.
* ``EngineClient`` is a protocol with two members written once for every implementation:
  ``generate`` (the public signature; it packs a ``RequestInput`` for the implementation's
  ``submit``) and the ``async with`` lifecycle (``start()`` ... ``shutdown()``). An
  implementation subclasses it by name to inherit them (``isinstance`` then holds before
  ``start()`` too); the server only types against it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import msgspec

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.front.input_processor import InputProcessor, Prompt, RequestInput
from deltaserve.engine.outputs import RequestOutput
from deltaserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deltaserve.engine.constraint import Constraint

__all__ = [
    "AbortingStream",
    "EngineClient",
    "ModelInfo",
    "OutputStream",
    "RequestInput",
    "not_started",
]

_C = TypeVar("_C")
_S_co = TypeVar("_S_co", bound="OutputStream", covariant=True)


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The served model: ``name`` is ``model.path`` as configured (e.g. ``builtin:tiny-qwen3.5``);
    ``checkpoint_unit`` = lcm(block_size, GDN chunk size); ``capacity`` is what
    ``Capacity.describe()`` gives (``{}`` when unknown)."""

    name: str
    model_type: str
    max_model_len: int
    vocab_size: int
    block_size: int
    checkpoint_unit: int
    capacity: dict[str, Any] = {}


@runtime_checkable
class OutputStream(Protocol):
    """One request's ``RequestOutput`` deltas; leaving the iteration early or ``aclose()``
    aborts the request."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None: ...


class AbortingStream:
    """The iteration every ``OutputStream`` shares: ``async for`` runs a fresh inner generator
    (leaving the loop early drops and finalises it, which abandons the request even while the
    caller still holds the stream), ``__anext__`` reads one delta (cancelled: abandoned),
    ``aclose`` abandons an unfinished request. A stream says how to read (``_next``, which sets
    ``finished`` with the last delta) and how to abandon (``_abandon``)."""

    finished: bool

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self._next()
        finally:
            if not self.finished:
                self._abandon()

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            return await self._next()
        except asyncio.CancelledError:
            self._abandon()
            raise

    async def aclose(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        if not self.finished:
            self._abandon()

    async def _next(self) -> RequestOutput:
        raise NotImplementedError

    def _abandon(self) -> None:
        raise NotImplementedError


@runtime_checkable
class EngineClient(Protocol[_S_co]):
    """An engine as a front end sees it. ``input_processor`` and ``model_info`` are valid after
    ``start()``; ``started`` is true from ``start()`` until ``shutdown()``. ``generate`` raises
    the typed errors (``deltaserve.engine.errors``) at the call, before any iteration."""

    config: EngineConfig

    @property
    def input_processor(self) -> InputProcessor: ...

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def started(self) -> bool: ...

    async def start(self: _C) -> _C: ...

    async def shutdown(self) -> None: ...

    def is_healthy(self) -> bool: ...

    def abort(self, request_id: str) -> Awaitable[bool]: ...

    def stats(self) -> dict[str, Any]: ...

    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> _S_co:
        """Submit a request; iterate the returned stream for its ``RequestOutput`` deltas.

        ``prompt`` is a str, a list of token ids, or chat messages (``[{"role", "content"}]``,
        content a string or a list of text parts; rendered with the tokenizer's chat template,
        which also gets ``tools`` and ``chat_template_kwargs``; ``chat_template``, Jinja text,
        renders this request instead). ``sampling_params`` fields left unset (temperature,
        top_p, top_k, min_p, repetition_penalty) take the model's defaults
        (``model.generation_config``); None: all of them. ``priority`` matters to the
        ``priority`` policy (lower first); ``cache_salt`` keeps tenants' cached prefixes apart.
        With ``SamplingParams.n > 1`` the stream carries ``n`` completions told apart by
        ``RequestOutput.index``. Raises ``InvalidRequestError`` / ``PromptTooLongError`` for bad
        input, ``EngineOverloadedError`` when the waiting queue is full, ``EngineDeadError``
        when the engine cannot serve.
        """
        return self.submit(
            RequestInput(
                prompt=prompt,
                sampling_params=sampling_params,
                request_id=request_id,
                priority=priority,
                cache_salt=cache_salt,
                tools=tools,  # type: ignore[arg-type]
                chat_template_kwargs=chat_template_kwargs,
                chat_template=chat_template,
            )
        )

    def submit(self, inp: RequestInput) -> _S_co:
        """Validate ``inp`` and start its request; the stream of its outputs (typed errors)."""
        raise NotImplementedError

    async def compile_constraint(self, constraint: Constraint) -> None:
        """Compile ``constraint`` where the engine core runs, waiting at most
        ``structured_outputs.compile_timeout_s``: a request submitted afterwards finds it compiled.
        Raises ``GrammarTimeoutError`` when time runs out (the compile goes on and is cached),
        ``InvalidRequestError`` when it does not compile. Optional: a request whose grammar is
        not compiled waits in the core (parked, off every loop) under the same deadline, and a
        client that does not implement this leaves it to that (an error then ends the stream)."""

    async def __aenter__(self: _C) -> _C:
        return await self.start()  # type: ignore[attr-defined,no-any-return]

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


def not_started(name: str) -> AttributeError:
    """What ``input_processor`` / ``model_info`` raise before ``start()``: an AttributeError, so
    that ``isinstance(client, EngineClient)``, which probes the members, answers instead of raising."""
    return AttributeError(f"{name} is not known until the engine has started (await engine.start())")
