"""``echo``, prompt logprobs and vLLM's ``prompt_logprobs`` through a real server and the official
``openai`` client: the prompt comes back before the completion, the prompt tokens' logprobs
equal transformers' log-softmax (tolerance: tests/engine/test_prompt_logprobs.py), and a plain
request running beside them keeps its prefix hit."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import torch

from deltaserve.models import ensure_builtin_model
from tests.tolerances import CPU_FP32

from .conftest import MODEL, Served

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman"
LONG = " ".join(["The engine schedules requests in batches and caches every prompt."] * 12)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        ensure_builtin_model("tiny-qwen3.5"), dtype=torch.float32
    ).eval()


def _ids(served: Served, text: str) -> list[int]:
    return served.engine.input_processor.tokenize(text)


def _assert_prompt_logprobs(hf_model: Any, ids: list[int], logprobs: list[float | None]) -> None:
    """``logprobs[p]`` (p >= 1) is token ``p``'s log-probability given the tokens before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits.double(), dim=-1)
    bound = 2 * CPU_FP32.bound(logits)[:, 0]
    assert logprobs[0] is None
    for p in range(1, len(ids)):
        got = logprobs[p]
        assert got is not None
        assert abs(got - ref[p - 1, ids[p]].item()) <= bound[p - 1].item(), f"position {p}"


async def test_echo_returns_the_prompt_before_the_completion(served: Served) -> None:
    client = served.client()
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0)
    plain = await client.completions.create(**kw)
    echoed = await client.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 5
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens


async def test_echo_with_logprobs_covers_the_prompt(served: Served, hf_model: Any) -> None:
    client = served.client()
    ids = _ids(served, PROMPT)
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0, logprobs=2)
    plain = await client.completions.create(**kw)
    resp = await client.completions.create(echo=True, **kw)
    lp = resp.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    token_text = served.app.state.server.token_text
    assert lp.tokens[:n] == [token_text(t) for t in ids]
    assert lp.top_logprobs[0] is None
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    _assert_prompt_logprobs(hf_model, ids, lp.token_logprobs[:n])
    # the completion's part is what the request without echo gets (up to fp32 rounding: the
    # batches differ; 2e-3 is twice the logits tolerance at these rows), its offsets after the prompt
    want = plain.choices[0].logprobs
    assert lp.tokens[n:] == want.tokens
    assert lp.token_logprobs[n:] == pytest.approx(want.token_logprobs, abs=2e-3)
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.text_offset[n:] == [len(PROMPT) + o for o in want.text_offset]


async def test_max_tokens_0_with_echo_returns_the_prompt_alone(served: Served, hf_model: Any) -> None:
    client = served.client()
    resp = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    c = resp.choices[0]
    ids = _ids(served, PROMPT)
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids)
    assert c.logprobs.top_logprobs[1:] == [{}] * (len(ids) - 1)
    _assert_prompt_logprobs(hf_model, ids, c.logprobs.token_logprobs)
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    # without echo there is nothing to return
    async with httpx.AsyncClient(base_url=served.url) as http:
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_lm_eval_loglikelihood_request(served: Served) -> None:
    """What lm-eval's ``local-completions`` sends for a loglikelihood: a batch of token-id
    prompts, echo, ``max_tokens: 1``, ``logprobs: 1``; it reads ``token_logprobs[ctxlen:-1]``
    and calls a continuation greedy when each equals the best of its ``top_logprobs``."""
    a, b = _ids(served, PROMPT), _ids(served, LONG)[:40]
    body = {
        "model": MODEL,
        "prompt": [a, b],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, c in zip([a, b], choices, strict=True):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1
        assert c["text"].startswith(
            served.engine.input_processor.tokenizer.decode(ids, skip_special_tokens=False)
        )
        tail = lp["token_logprobs"][5:-1]
        tops = lp["top_logprobs"][5:-1]
        assert all(isinstance(x, float) and x <= 0 for x in tail)
        # the best alternative is at least as likely as the token, and exactly as likely for a
        # greedy token (lm-eval compares the floats): the generated one is, at temperature 0
        assert all(max(top.values()) >= x for x, top in zip(tail, tops, strict=True))
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())


async def test_prompt_logprobs_field(served: Served, hf_model: Any) -> None:
    client = served.client()
    ids = _ids(served, PROMPT)
    resp = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0.0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 3},
    )
    c = resp.choices[0]
    plp = c.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    token_text = served.app.state.server.token_text
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert entry["logprob"] == c.logprobs.token_logprobs[p]
        assert entry["decoded_token"] == token_text(ids[p])
        ranked = sorted((e["rank"], e["logprob"]) for e in plp[p].values())
        assert {e["rank"] for e in plp[p].values()} >= {1, 2, 3}
        assert [lp for _, lp in ranked] == sorted([lp for _, lp in ranked], reverse=True)
        assert len(plp[p]) in (3, 4)  # the top 3, and the prompt token when not among them
    _assert_prompt_logprobs(
        hf_model, ids, [None if e is None else e[str(t)]["logprob"] for e, t in zip(plp, ids)]
    )
    # chat: at the top of the response (vLLM's shape)
    chat = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        temperature=0.0,
        extra_body={"prompt_logprobs": 0},
    )
    cplp = chat.model_extra["prompt_logprobs"]
    assert len(cplp) == chat.usage.prompt_tokens and cplp[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in cplp[1:])
    async with httpx.AsyncClient(base_url=served.url) as http:
        bad = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": True, "prompt_logprobs": 1}
        )
        too_many = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 21}
        )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


async def test_streamed_echo_puts_the_prompt_in_the_first_chunk(served: Served) -> None:
    client = served.client()
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=1)
    whole = await client.completions.create(echo=True, **kw)
    stream = await client.completions.create(echo=True, stream=True, **kw)
    chunks = [c async for c in stream]
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert texts[0].startswith(PROMPT)
    assert "".join(texts) == whole.choices[0].text
    first = chunks[0].choices[0].logprobs
    n = len(_ids(served, PROMPT))
    assert first.token_logprobs[0] is None and len(first.tokens) >= n
    streamed = [
        x
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.token_logprobs
    ]
    offsets = [
        x
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.text_offset
    ]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    assert offsets == whole.choices[0].logprobs.text_offset
    # the prompt alone, streamed: one chunk with it and the finish reason, no completion tokens
    alone = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=0,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    got = [c async for c in alone]
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in got if c.choices] == [(PROMPT, "length")]
    assert got[-1].usage.completion_tokens == 0


async def test_echo_with_n_gives_every_choice_the_prompt(served: Served) -> None:
    client = served.client()
    resp = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=1.0, seed=5, n=2, echo=True, logprobs=0
    )
    assert [c.index for c in resp.choices] == [0, 1]
    n = len(_ids(served, PROMPT))
    for c in resp.choices:
        assert c.text.startswith(PROMPT)
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == n + 3
    first, second = (c.logprobs.token_logprobs for c in resp.choices)
    assert second[1:n] == pytest.approx(first[1:n], abs=2e-3)  # each computed its prompt


async def test_a_plain_request_beside_echo_keeps_its_prefix_hit(served: Served) -> None:
    client = served.client()
    kw: dict[str, Any] = dict(model=MODEL, prompt=LONG, max_tokens=4, temperature=0.0)
    kw["extra_body"] = {"cache_salt": "echo-neighbour"}  # a cold cache for this test
    first = await client.completions.create(**kw)
    assert first.usage.prompt_tokens > 128
    echoed, plain = await asyncio.gather(
        client.completions.create(echo=True, logprobs=1, **kw), client.completions.create(**kw)
    )
    assert plain.usage.prompt_tokens_details.cached_tokens > 0
    assert plain.choices[0].text == first.choices[0].text
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0  # it computed the whole prompt
    assert echoed.choices[0].text == LONG + first.choices[0].text
    stats = await served.wait_idle()
    assert stats["scheduler.running"] == 0
