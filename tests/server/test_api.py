"""The OpenAI-compatible server end to end: the official ``openai`` client against a server on
127.0.0.1 and a free port, over the built-in tiny model (random weights: texts are gibberish,
so the checks compare against the engine itself and the model's own numbers)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.engine import SamplingParams

from .conftest import MODEL, Served

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER = [{"role": "user", "content": "Once upon a time, in a small village by the sea"}]


async def engine_text(served: Served, prompt: Any, max_tokens: int, **kw: Any) -> tuple[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    text, ids = "", []
    async for out in served.engine.generate(prompt, params):
        text += out.text
        ids += out.token_ids
    return text, ids


async def test_chat_greedy_matches_the_engine_streaming_or_not(served: Served) -> None:
    want, _ = await engine_text(served, USER, 12)
    client = served.client()
    resp = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].message.content == want and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens > 0
    # the engine's run of the same prompt left a tail checkpoint at its last full block
    assert resp.usage.prompt_tokens_details.cached_tokens == (resp.usage.prompt_tokens - 1) // 16 * 16
    assert resp.model == MODEL and resp.object == "chat.completion"

    stream = await client.chat.completions.create(
        model="tiny", messages=USER, max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, reasons, usage, roles = "", [], None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            roles += [c.delta.role] if c.delta.role else []
            reasons += [c.finish_reason] if c.finish_reason else []
    assert text == want and reasons == ["length"] and roles == ["assistant"]
    assert usage is not None and usage.completion_tokens == 12


async def test_completions_text_token_ids_and_batch(served: Served) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    want, ids = await engine_text(served, prompt, 8)
    client = served.client()
    extra = {"ignore_eos": True}
    resp = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
    )
    assert resp.choices[0].text == want and resp.usage.completion_tokens == 8
    tokens = served.engine.core.tokenize(prompt)
    resp = await client.completions.create(
        model=MODEL, prompt=tokens, max_tokens=8, temperature=0, extra_body=extra
    )
    assert resp.choices[0].text == want
    resp = await client.completions.create(
        model=MODEL, prompt=[prompt, tokens], max_tokens=8, temperature=0, extra_body=extra
    )
    assert [c.index for c in resp.choices] == [0, 1] and {c.text for c in resp.choices} == {want}
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body=extra
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == want


async def test_second_chat_turn_reports_cached_tokens(served: Served) -> None:
    client = served.client()
    system = " ".join(["You are a helpful assistant. Answer the question briefly and clearly."] * 10)
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"cache_salt": "turns"}
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"cache_salt": "turns"}
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 128 and cached < second.usage.prompt_tokens


async def test_32_concurrent_streams_all_complete(served: Served) -> None:
    client = served.client()

    async def one(i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i}: the weather today is", max_tokens=6, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, reason = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=120)
    assert [r for _, r in results] == ["length"] * 32
    stats = await served.wait_idle()
    assert stats["live_slots.used"] == 0 and stats["kv.pinned_blocks"] == 0


async def test_disconnect_mid_stream_aborts_and_frees_everything(served: Served) -> None:
    await served.wait_idle()
    before = served.engine.stats()
    body = {"model": MODEL, "messages": USER, "max_tokens": 5000, "stream": True, "ignore_eos": True}
    url = served.url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http, http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        got = 0
        async for line in resp.aiter_lines():
            got += line.startswith("data: ")
            if got >= 4:
                break  # leave: the connection closes
    stats = await served.wait_idle()
    assert stats["requests.aborted"] == before["requests.aborted"] + 1
    assert stats["live_slots.used"] == 0 and stats["kv.pinned_blocks"] == 0
    assert stats["tokens.generated"] - before["tokens.generated"] < 1000
    # a non-streaming request whose client gives up is aborted too
    async with httpx.AsyncClient(timeout=0.5) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post(served.url + "/v1/chat/completions", json={**body, "stream": False})
    stats = await served.wait_idle()
    assert stats["requests.aborted"] == before["requests.aborted"] + 2


async def test_metrics_parse_and_move(served: Served) -> None:
    async with httpx.AsyncClient(timeout=30) as http:

        async def scrape() -> dict[str, float]:
            text = (await http.get(served.url + "/metrics")).text
            out: dict[str, float] = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    labels = dict(s.labels)
                    assert labels.pop("model_name") == MODEL, s  # every series: the first served name
                    key = s.name + (
                        "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else ""
                    )
                    out[key] = s.value
            return out

        before = await scrape()
        resp = await http.post(
            served.url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True},
        )
        assert resp.status_code == 200
        await http.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 7})
        after = await scrape()
    for name in ("deltaserve:num_requests_running", "deltaserve:num_requests_waiting", "deltaserve:kv_cache_usage_perc",
                 "deltaserve:checkpoint_pool_usage_perc", "deltaserve:checkpoints_stored_total",
                 "deltaserve:checkpoints_evicted_total", "deltaserve:checkpoints_skipped_total{reason=budget}",
                 "deltaserve:num_preemptions_total", "deltaserve:prefix_cache_queries_total",
                 "deltaserve:checkpoints_skipped_total{reason=value}",
                 "deltaserve:checkpoint_reuse_rate{kind=output}", "deltaserve:cache_pages{use=kv}",
                 "deltaserve:cache_pages{use=checkpoint}", "deltaserve:kv_moved_blocks_total",
                 "deltaserve:cache_page_conversions_total{to=checkpoint}"):  # fmt: skip
        assert name in after, name
    assert after["deltaserve:request_success_total{finished_reason=length}"] == before.get(
        "deltaserve:request_success_total{finished_reason=length}", 0) + 1  # fmt: skip
    assert after["deltaserve:generation_tokens_total"] >= before["deltaserve:generation_tokens_total"] + 4
    assert after["deltaserve:prefix_cache_queries_total"] > before["deltaserve:prefix_cache_queries_total"]
    assert (
        after["deltaserve:time_to_first_token_seconds_count"]
        == before["deltaserve:time_to_first_token_seconds_count"] + 1
    )
    assert (
        after["deltaserve:inter_token_latency_seconds_count"]
        >= before["deltaserve:inter_token_latency_seconds_count"] + 3
    )
    assert (
        after["deltaserve:e2e_request_latency_seconds_count"]
        == before["deltaserve:e2e_request_latency_seconds_count"] + 1
    )
    assert (
        after["deltaserve:http_errors_total{status=400}"]
        == before.get("deltaserve:http_errors_total{status=400}", 0) + 1
    )


async def test_models_health_tokenize_detokenize(served: Served) -> None:
    client = served.client()
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL, "tiny"]
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        assert (await http.get("/health")).status_code == 200
        tok = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
        assert tok["tokens"] == served.engine.core.tokenize("Hello world") and tok["count"] == len(
            tok["tokens"]
        )
        chat = (await http.post("/tokenize", json={"messages": USER})).json()
        assert chat["tokens"] == served.engine.core.tokenize(USER)
        text = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
        assert text == {"prompt": "Hello world"}
        bad = await http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


async def test_errors_have_openai_shape(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        chat = "/v1/chat/completions"
        ok = {"model": MODEL, "messages": USER, "max_tokens": 2}
        cases: list[tuple[str, Any, int, str | None]] = [
            (chat, b"{not json", 400, None),
            (chat, {"model": MODEL}, 400, "messages"),
            (chat, {**ok, "max_tokens": "ten"}, 400, "max_tokens"),
            (chat, {**ok, "max_tokens": 0}, 400, "max_tokens"),
            (chat, {**ok, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
            (chat, {**ok, "temperature": -1}, 400, "temperature"),
            (chat, {**ok, "top_p": 0}, 400, "top_p"),
            (chat, {**ok, "n": 0}, 400, "n"),
            (chat, {**ok, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
            (chat, {**ok, "presence_penalty": 3}, 400, "presence_penalty"),
            (chat, {**ok, "repetition_penalty": 0}, 400, "repetition_penalty"),
            (chat, {**ok, "min_p": 2}, 400, "min_p"),
            (chat, {**ok, "seed": -1}, 400, "seed"),
            (chat, {**ok, "stop": [""]}, 400, "stop"),
            (chat, {**ok, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
            (chat, {**ok, "messages": []}, 400, "messages"),
            (
                chat,
                {**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                400,
                "messages",
            ),
            (chat, {**ok, "messages": [{"role": "user", "content": "x " * 20000}]}, 400, "messages"),
            (chat, {**ok, "model": "gpt-4"}, 404, "model"),
            (chat, {**ok, "logit_bias": {"5": 10}}, 400, "logit_bias"),
            (chat, {**ok, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
            ("/v1/completions", {"model": MODEL, "prompt": [1.5]}, 400, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
            ("/v1/embeddings", {}, 404, None),
        ]
        for path, body, status, param in cases:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = await http.post(path, **kw)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["param"] == param, (body, err)
            assert err["message"] and "Traceback" not in err["message"]
        r = await http.get("/v1/chat/completions")
        assert r.status_code == 405 and "error" in r.json()
