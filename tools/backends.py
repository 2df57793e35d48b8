"""The backends loadgen sends a workload through, one interface: ``start``, ``stream(spec)``
(``Delta``s: token ids as they arrive, then a final one with the finish reason and prompt and
cached token counts), ``stats``, ``describe``, ``stop``.

``EngineBackend``: an in-process ``AsyncEngine``. ``OpenAIBackend``: any OpenAI-compatible
server over HTTP (streamed token-id completions). ``HFBackend``: transformers ``generate``, one
request at a time (an application without a serving engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from deltaserve.tools.metrics import prometheus_stats
from deltaserve.tools.workloads import RequestSpec


@dataclass
class Delta:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = True
    seed: int | None = None


class EngineBackend:
    """``AsyncEngine`` over one ``EngineCore``."""

    kind = "engine"

    def __init__(self, core: Any, sampling: Sampling) -> None:
        from deltaserve.engine import AsyncEngine

        self.core = core
        self.sampling = sampling
        self.engine = AsyncEngine(core=core)

    @property
    def model_path(self) -> str:
        return str(self.core.loaded.path)

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.shutdown()

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Delta]:
        from deltaserve.engine import SamplingParams

        params = SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            ignore_eos=self.sampling.ignore_eos,
            seed=self.sampling.seed,
        )
        salt = spec.meta.get("cache_salt")
        async for o in self.engine.generate(
            list(spec.prompt_ids), params, request_id=spec.rid, cache_salt=salt
        ):
            yield Delta(
                token_ids=list(o.token_ids),
                finished=o.finished,
                finish_reason=o.finish_reason,
                num_prompt_tokens=o.num_prompt_tokens,
                num_cached_tokens=o.num_cached_tokens,
                error=o.error,
            )

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model_path, "config": self.core.config.to_dict()}


class OpenAIBackend:
    """Any OpenAI-compatible server (deltaserve serve, vLLM, SGLang, ...) over HTTP.

    Each request is a streamed ``POST /v1/completions`` whose ``prompt`` is the workload's
    token ids (the same prompts every backend gets; the server must use the same tokenizer),
    with ``stream_options.include_usage`` and the extras ``ignore_eos`` and
    ``return_token_ids`` (vLLM's names; deltaserve has both). TTFT and ITL are taken from SSE
    arrival times; prompt and cached tokens from the final ``usage``
    (``prompt_tokens_details.cached_tokens``). A server that does not return token ids gets its
    text re-encoded with the workload's tokenizer (token counts then approximate). Engine
    counters are read from ``/metrics`` when it exposes ``deltaserve:``, ``vllm:`` or
    ``llamacpp:`` ones (``metrics.prometheus_stats``).
    """

    kind = "openai"

    def __init__(
        self, base_url: str, sampling: Sampling, *, model: str | None = None, codec: Any = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.sampling = sampling
        self.model = model
        self.codec = codec
        self._client: Any = None
        self._last_stats: dict[str, Any] = {}

    @property
    def model_path(self) -> str:
        return self.model or ""

    async def start(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(600.0), limits=limits)
        if self.model is None:
            resp = await self._client.get("/v1/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]

    async def refresh_stats(self) -> None:
        self._last_stats = await self._scrape()

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(spec.prompt_ids),
            "max_tokens": spec.max_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.sampling.ignore_eos,
            "return_token_ids": True,
        }
        if self.sampling.seed is not None:
            body["seed"] = self.sampling.seed
        if spec.meta.get("cache_salt"):
            body["cache_salt"] = spec.meta["cache_salt"]
        return body

    def _choice_ids(self, choice: dict[str, Any]) -> list[int]:
        """A choice's token ids; the text re-encoded when the server returns none (a text
        without a codec counts as one token)."""
        ids = choice.get("token_ids")
        if ids is None:
            text = choice.get("text") or ""
            ids = self.codec.encode(text) if (text and self.codec is not None) else ([0] if text else [])
        return list(ids)

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Delta]:
        n_prompt = len(spec.prompt_ids)
        reason: str | None = None
        async with self._client.stream("POST", "/v1/completions", json=self._body(spec)) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {await _error_message(resp)}")
            async for data in sse_data(resp.aiter_raw()):
                if data == b"[DONE]":
                    break
                chunk = _decode(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error mid-stream: {chunk['error'].get('message')}")
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    yield Delta(
                        [], finished=True, finish_reason=reason or "length",
                        num_prompt_tokens=usage.get("prompt_tokens") or n_prompt,
                        num_cached_tokens=details.get("cached_tokens") or 0,
                    )  # fmt: skip
                    return
                for choice in chunk.get("choices") or []:
                    ids = self._choice_ids(choice)
                    reason = choice.get("finish_reason") or reason
                    if ids:
                        yield Delta(ids, num_prompt_tokens=n_prompt)
        yield Delta([], finished=True, finish_reason=reason or "length", num_prompt_tokens=n_prompt)

    async def _scrape(self) -> dict[str, Any]:
        """Engine counters from ``/metrics`` under the stats names the summary uses ({} if none):
        deltaserve's, vLLM's or llama.cpp's (``metrics.prometheus_stats``)."""
        try:
            resp = await self._client.get("/metrics")
        except Exception:  # no metrics endpoint (or the server went away)
            return {}
        return prometheus_stats(resp.text) if resp.status_code == 200 else {}

    def stats(self) -> dict[str, Any]:
        return dict(self._last_stats)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "base_url": self.base_url, "model": self.model}


_decode = msgspec.json.Decoder().decode


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent-event byte stream, one per event line.

    Splits on raw bytes (CRLF or LF line ends) instead of decoding and iterating text lines: at
    tens of streams the client's per-event work runs on the same CPU as the server it measures.
    """
    buf = b""
    async for piece in chunks:
        buf += piece
        if b"\r" in buf:
            if buf.endswith(b"\r"):
                continue  # the LF of a CRLF may be in the next piece
            buf = buf.replace(b"\r\n", b"\n")
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = buf[start:end]
            start = end + 1
            if line.startswith(b"data:"):
                yield line[5:].strip()
        buf = buf[start:]
    if buf.startswith(b"data:"):
        yield buf[5:].strip()


async def _error_message(resp: Any) -> str:
    """The ``error.message`` of a failed response's JSON body, else the body's start."""
    text = (await resp.aread()).decode(errors="replace")
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


class HFBackend:
    """transformers ``generate``: one request at a time, no batching, no prefix cache."""

    kind = "hf"

    def __init__(
        self, model_path: str, sampling: Sampling, *, device: str = "cpu", dtype: str = "float32"
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.path = model_path
        from deltaserve.engine.core.builder import choose_device, resolve_dtype  # the engine's own tables

        device = str(choose_device(device)[0])  # "auto" as the engine resolves it
        self.device = device
        torch_dtype = resolve_dtype(dtype, torch.device(device))
        self.dtype = str(torch_dtype).removeprefix("torch.")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
        self.sampling = sampling
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self._lock: asyncio.Lock | None = None
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    @property
    def model_path(self) -> str:
        return self.path

    async def start(self) -> None:
        self._lock = asyncio.Lock()

    async def stop(self) -> None:
        self._executor.shutdown(wait=True)

    def _generate(self, spec: RequestSpec, put: Any) -> None:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch

        class Streamer(BaseStreamer):
            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # the first call carries the prompt
                    self.prompt_seen = True
                    return
                put(value.reshape(-1).tolist())

            def end(self) -> None:
                pass

        ids = torch.tensor([list(spec.prompt_ids)], device=self.device)
        kwargs: dict[str, Any] = {"max_new_tokens": spec.max_tokens, "pad_token_id": 0, "min_new_tokens": 0}
        if self.sampling.ignore_eos:
            kwargs["eos_token_id"] = None
        if self.sampling.temperature > 0:
            if self.sampling.seed is not None:
                torch.manual_seed(self.sampling.seed)
            kwargs.update(
                do_sample=True, temperature=self.sampling.temperature, top_p=self.sampling.top_p, top_k=0
            )
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.no_grad():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=Streamer(), **kwargs)

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Delta]:
        assert self._lock is not None, "backend not started"
        async with self._lock:  # one request at a time, in arrival order
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[list[int]] = asyncio.Queue()

            def put(tokens: list[int]) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, tokens)

            fut = loop.run_in_executor(self._executor, self._generate, spec, put)
            n = 0
            reason = "length"
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    tokens = getter.result()
                    n += len(tokens)
                    if not self.sampling.ignore_eos and any(t in self.eos_ids for t in tokens):
                        reason = "stop"
                    yield Delta(tokens, num_prompt_tokens=len(spec.prompt_ids))
                    continue
                getter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await getter
                while not queue.empty():
                    tokens = queue.get_nowait()
                    n += len(tokens)
                    yield Delta(tokens, num_prompt_tokens=len(spec.prompt_ids))
                break
            err = fut.exception()
            yield Delta(
                [],
                finished=True,
                finish_reason="error" if err else reason,
                num_prompt_tokens=len(spec.prompt_ids),
                error=f"{type(err).__name__}: {err}" if err else None,
            )

    def stats(self) -> dict[str, Any]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.path, "device": self.device, "dtype": self.dtype}
