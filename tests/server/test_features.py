"""Sampling and chat features through the server and on ``AsyncEngine`` directly: ``n`` (one
prefill), logprobs (the model's raw log-softmax), penalties, tools and template arguments."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from deltaserve.engine import InvalidRequestError, SamplingParams

from .conftest import MODEL, Served

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER = [{"role": "user", "content": "Once upon a time, in a small village by the sea"}]


async def engine_text(served: Served, prompt: Any, max_tokens: int, **kw: Any) -> tuple[str, list[int]]:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=kw.pop("temperature", 0.0), ignore_eos=True, **kw
    )
    text, ids = "", []
    async for out in served.engine.generate(prompt, params):
        text += out.text
        ids += out.token_ids
    return text, ids


async def test_n_with_seed_is_reproducible_and_prefills_once(served: Served) -> None:
    system = " ".join(["The engine schedules requests in batches and caches every prompt."] * 12)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a story."}]
    client = served.client()
    await served.wait_idle()
    before = served.engine.stats()
    kw: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=11)
    kw["extra_body"] = {"ignore_eos": True, "cache_salt": "n-test"}  # a cold cache for this test
    first = await client.chat.completions.create(n=3, **kw)
    after = served.engine.stats()
    prompt_len = first.usage.prompt_tokens
    assert prompt_len > 128 and [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1  # seed + i: different samples
    assert first.usage.completion_tokens == 18
    computed = after["tokens.computed"] - before["tokens.computed"]
    # one prefill: the children start from the first one's cached prompt (at most a checkpoint
    # unit of its tail recomputed each), then 3 x 6 decode tokens (the first comes with prefill)
    unit = served.engine.core.cache.unit
    assert computed <= prompt_len + 2 * unit + 3 * 6, (computed, prompt_len)
    assert computed < 2 * prompt_len
    again = await client.chat.completions.create(n=3, **kw)
    assert [c.message.content for c in again.choices] == texts
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # streaming: the same three texts, by index
    stream = await client.chat.completions.create(n=3, stream=True, **kw)
    got = ["", "", ""]
    async for chunk in stream:
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
    assert got == texts


async def test_logprobs_are_the_models_log_softmax(served: Served, tiny_loaded: Any) -> None:
    client = served.client()
    resp = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, temperature=0.8, seed=3, logprobs=True, top_logprobs=4,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    entries = resp.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 4 for e in entries)
    # the same seeded request on the engine gives the sampled ids
    _, sampled = await engine_text(served, USER, 5, seed=3, temperature=0.8)
    server = served.app.state.server
    assert [e.token for e in entries] == [server.token_text(t) for t in sampled]
    # reference: transformers' model on the same weights, on prompt + the sampled tokens; raw
    # log-softmax although the request sampled at temperature 0.8
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_loaded.path, dtype=torch.float32).eval()
    prompt = served.engine.core.tokenize(USER)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + sampled])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(sampled)]
    for j, e in enumerate(entries):
        assert e.logprob == pytest.approx(ref[j, sampled[j]].item(), abs=2e-3)
        assert e.bytes == list(e.token.encode())
        top = ref[j].topk(4)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert [t.token for t in e.top_logprobs] == [server.token_text(i) for i in top.indices.tolist()]
    # completions: the legacy shape
    resp = await client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 3 == len(lp.token_logprobs) == len(lp.top_logprobs) and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert lp.token_logprobs == pytest.approx([max(t.values()) for t in lp.top_logprobs])


async def test_tool_messages_render_through_the_template(served: Served) -> None:
    client = served.client()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    resp = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="auto", max_tokens=4, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.choices[0].message.tool_calls is None  # random weights never emit a <tool_call>


async def test_engine_n_forks_after_the_first_prefill(served: Served) -> None:
    prompt = " ".join(["Every morning she walked to the harbour and counted the boats."] * 8)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=5, n=4, ignore_eos=True)
    await served.wait_idle()
    before = served.engine.stats()
    outs = [o async for o in served.engine.generate(prompt, params, request_id="fork", cache_salt="fork")]
    stats = await served.wait_idle()
    assert {o.request_id for o in outs} == {"fork"} and {o.index for o in outs} == {0, 1, 2, 3}
    finals = [o for o in outs if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2, 3] and all(
        o.finish_reason == "length" for o in finals
    )
    per = {i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(4)}
    assert all(len(v) == 5 for v in per.values())
    # completion i is the seeded request seed + i on its own
    for i in (0, 3):
        _, alone = await engine_text(served, prompt, 5, temperature=1.0, seed=5 + i)
        assert per[i] == alone
    prompt_len = outs[0].num_prompt_tokens
    computed = stats["tokens.computed"] - before["tokens.computed"]
    assert computed <= prompt_len + 3 * served.engine.core.cache.unit + 4 * 5
    # leaving a forked stream early aborts all its completions
    stream = served.engine.generate(prompt, SamplingParams(max_tokens=3000, n=3, ignore_eos=True))
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 6:
            break
    stats = await served.wait_idle()
    assert stats["live_slots.used"] == 0 and stats["kv.pinned_blocks"] == 0
    # abort(request_id) ends every completion, submitted or not
    stream = served.engine.generate(
        prompt, SamplingParams(max_tokens=3000, n=3, ignore_eos=True), request_id="ab"
    )
    first = await stream.__anext__()
    assert await served.engine.abort("ab")
    rest = [first] + [o async for o in stream]
    assert sorted(o.index for o in rest if o.finished) == [0, 1, 2]
    assert {o.finish_reason for o in rest if o.finished} == {"abort"}
    await served.wait_idle()


async def test_engine_logprobs_penalties_and_template_arguments(served: Served) -> None:
    engine = served.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = [o async for o in engine.generate("Hello there", params)]
    entries = [lp for o in outs for lp in (o.logprobs or [])]
    assert [e.token_id for e in entries] == [t for o in outs for t in o.token_ids]
    assert all(e.rank == 1 and len(e.top) == 3 and e.top[0][0] == e.token_id for e in entries)
    assert [o.logprobs for o in [o async for o in engine.generate("Hi", SamplingParams(max_tokens=2))]] == [
        None,
        None,
    ]

    # penalties and min-p through the runner's sampling path, on logits where they must matter
    from deltaserve.engine.runner.request_state import RequestState
    from deltaserve.scheduler.request import Request

    def pick(**kw: Any) -> tuple[int, Any]:
        req = Request("p", [5, 7], SamplingParams(max_tokens=9, **kw))
        req.append_token(8)
        state = RequestState(stop_ids=frozenset(), generator=None)
        logits = torch.full((1, engine.core.vocab_size), -20.0)
        logits[0, 5], logits[0, 6], logits[0, 8] = 10.0, 9.0, 9.5
        token = engine.core.runner.sample(logits, [req], {"p": state})[0]
        return token, state.logprobs

    assert pick(temperature=0)[0] == 5
    assert pick(temperature=0, repetition_penalty=2.0)[0] == 6  # 10 -> 5 and 9.5 -> 4.75 (seen)
    assert pick(temperature=0, presence_penalty=2.0)[0] == 5  # only the output token 8 pays
    assert pick(temperature=0, frequency_penalty=1.0, repetition_penalty=1.2)[0] == 6
    assert {pick(temperature=1.0, min_p=0.7)[0] for _ in range(20)} == {5}  # e^-0.5 = 0.61 < 0.7
    token, lps = pick(temperature=0, repetition_penalty=2.0, logprobs=2)
    raw = torch.log_softmax(torch.tensor([10.0, 9.0, 9.5] + [-20.0] * (engine.core.vocab_size - 3)), -1)
    assert lps[0].token_id == 6 and lps[0].logprob == pytest.approx(
        raw[1].item(), abs=1e-5
    )  # raw, not penalised
    assert lps[0].rank == 3 and [t for t, _ in lps[0].top] == [5, 8]

    # content parts are text parts joined; tools and template kwargs reach the template
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}
    ]
    assert engine.core.tokenize(parts) == engine.core.tokenize([{"role": "user", "content": "Hello\nthere"}])
    seen: dict[str, Any] = {}
    tok = engine.core.tokenizer
    original = tok.apply_chat_template

    def spy(messages: Any, **kw: Any) -> Any:
        seen.update(kw, messages=messages)
        return original(messages, **{k: v for k, v in kw.items() if k not in ("tools", "enable_thinking")})

    tok.apply_chat_template = spy
    try:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        msgs = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]},
        ]
        [o async for o in engine.generate(msgs, SamplingParams(max_tokens=1), tools=tools,
                                          chat_template_kwargs={"enable_thinking": False})]  # fmt: skip
    finally:
        tok.apply_chat_template = original
    assert (
        seen["tools"] == tools and seen["enable_thinking"] is False and seen["add_generation_prompt"] is True
    )
    assert seen["messages"][1]["content"] == "" and seen["messages"][1]["tool_calls"][0]["id"] == "1"
    for kwargs, match in (
        ({"tools": "f"}, "tools must be a list"),
        ({"chat_template_kwargs": {"tokenize": True}}, "may not set"),
        ({"chat_template_kwargs": []}, "must be an object"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            engine.generate(USER, SamplingParams(max_tokens=1), **kwargs)
    with pytest.raises(InvalidRequestError, match="chat messages only"):
        engine.generate("text", SamplingParams(max_tokens=1), tools=[])
    with pytest.raises(InvalidRequestError, match="only text parts"):
        engine.generate([{"role": "user", "content": [{"type": "image_url"}]}], SamplingParams(max_tokens=1))
    await asyncio.sleep(0)
