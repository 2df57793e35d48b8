"""Workload generators: deterministic under a seed, and the sharing structure each promises."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from deltaserve.tools.workloads import (
    LARGE_WORKLOADS,
    PRESSURE_WORKLOADS,
    VARIANT_WORKLOADS,
    WORKLOADS,
    ArrivalParams,
    Codec,
    RequestSpec,
    SyntheticCodec,
    WorkloadParams,
    common_prefix_len,
    expand,
    make_workload,
    plan_arrivals,
    synthetic_reply,
    workload_names,
)

SMALL = {
    "chat": {"sessions": 3, "turns": 3, "prefix_len": 40, "prompt_len": 20, "output_len": 8},
    "shared-prefix": {"num_requests": 6, "prefix_len": 100, "prompt_len": 20, "output_len": 4},
    "prefix-repetition": {"num_prefixes": 3, "suffixes_per_prefix": 4, "prefix_len": 70, "prompt_len": 20, "output_len": 4},
    "shifted-prefix": {"num_requests": 5, "prefix_len": 90, "prompt_len": 60, "output_len": 4},
    "agent": {"sessions": 2, "turns": 4, "prefix_len": 50, "prompt_len": 20, "output_len": 8, "tool_len": 16},
    "random": {"num_requests": 8, "prompt_len": 40, "output_len": 4},
    "multi-turn": {"sessions": 3, "turns": 4, "min_turns": 2, "prefix_len": 40, "session_prefix_len": 60, "prompt_len": 20, "output_len": 8},
    "swe-agent": {"sessions": 2, "turns": 4, "min_turns": 3, "prefix_len": 60, "prompt_len": 20, "output_len": 8, "tool_len": 30},
    "tree": {"sessions": 2, "prefix_len": 30, "prompt_len": 40, "output_len": 8, "branches": 3, "beam": 1, "depth": 2},
    "tenants": {"sessions": 12, "tenants": 3, "volatile_every": 2, "prefix_len": 60, "prompt_len": 20, "output_len": 8},
    "tenants-shift": {"sessions": 12, "tenants": 3, "volatile_every": 2, "prefix_len": 60, "prompt_len": 20, "output_len": 8},
}  # fmt: skip


def build(name: str, codec: Codec, seed: int = 0, **kw: object) -> list[tuple[RequestSpec, list[int]]]:
    params = WorkloadParams(name=name, seed=seed, **{**SMALL[name], **kw})  # type: ignore[arg-type]
    return expand(make_workload(params, codec))


def sequences(reqs: list[tuple[RequestSpec, list[int]]]) -> list[tuple[str, list[int], int, list[int]]]:
    return [(s.rid, s.prompt_ids, s.max_tokens, r) for s, r in reqs]


@pytest.mark.parametrize("name", list(SMALL))
def test_deterministic_under_seed(name: str, codec: Codec) -> None:
    a = sequences(build(name, codec, seed=1))
    b = sequences(build(name, codec, seed=1))
    c = sequences(build(name, codec, seed=2))
    assert a == b
    assert [x[1] for x in a] != [x[1] for x in c]


def test_default_sizes_and_expected_counts(tiny_codec: Codec) -> None:
    for name in workload_names("all"):
        w = make_workload(WorkloadParams(name=name), tiny_codec)
        reqs = expand(w)
        assert len(reqs) == w.expected_requests() > 0, name
        assert len({s.rid for s, _ in reqs}) == len(reqs), f"{name}: request ids not unique"
        assert all(len(r) == s.max_tokens for s, r in reqs)


def test_text_tokens_are_realistic(tiny_codec: Codec) -> None:
    (spec, _), *_ = build("random", tiny_codec, prompt_len=200, len_jitter=0.0)
    text = tiny_codec.decode(spec.prompt_ids)
    assert 200 <= len(spec.prompt_ids) <= 206
    words = text.split()
    assert 1.0 <= len(spec.prompt_ids) / len(words) <= 3.5  # English-like words, not random ids
    assert tiny_codec.encode(text) == spec.prompt_ids


def test_shared_prefix_shares_exactly_the_prefix(codec: Codec) -> None:
    reqs = build("shared-prefix", codec)
    n = reqs[0][0].meta["prefix_tokens"]
    prompts = [s.prompt_ids for s, _ in reqs]
    assert n >= 100
    for i, a in enumerate(prompts):
        assert a[:n] == prompts[0][:n]
        for b in prompts[i + 1 :]:
            assert common_prefix_len(a, b) == n  # questions start with distinct tokens
    if not isinstance(codec, SyntheticCodec):  # (its decode is lossy: hashed chunks)
        assert codec.decode(prompts[0][:n]).startswith("<|im_start|>system\n")


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_shifted_prefix_ends_mid_block(codec: Codec, block_size: int) -> None:
    for prefix_len in (64, 90, 128, 256):
        reqs = build("shifted-prefix", codec, prefix_len=prefix_len, block_size=block_size)
        n = reqs[0][0].meta["prefix_tokens"]
        assert n % block_size != 0
        prompts = [s.prompt_ids for s, _ in reqs]
        assert all(p[:n] == prompts[0][:n] for p in prompts)
        assert all(common_prefix_len(a, b) == n for a in prompts for b in prompts if a is not b)
        assert all(len(p) - n >= 45 for p in prompts)  # long unique parts


def test_prefix_repetition_k_prefixes_times_m(codec: Codec) -> None:
    reqs = build("prefix-repetition", codec)
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for s, _ in reqs:
        n = s.meta["prefix_tokens"]
        groups.setdefault(tuple(s.prompt_ids[:n]), []).append(s.prompt_ids)
    assert len(groups) == 3
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    prefixes = list(groups)
    for i, a in enumerate(prefixes):
        for b in prefixes[i + 1 :]:
            assert common_prefix_len(a, b) == 0
        for x in groups[a]:
            for y in groups[a]:
                if x is not y:
                    assert common_prefix_len(x, y) == len(a)
    order = [s.meta["prefix"] for s, _ in reqs]
    assert order != sorted(order), "requests are shuffled"


def test_random_shares_nothing(codec: Codec) -> None:
    prompts = [s.prompt_ids for s, _ in build("random", codec)]
    assert all(common_prefix_len(a, b) == 0 for a in prompts for b in prompts if a is not b)


def test_chat_next_turn_extends_prompt_and_reply(codec: Codec) -> None:
    reqs = build("chat", codec)
    by_rid = {s.rid: (s, r) for s, r in reqs}
    assert len(reqs) == 9
    for s, _ in reqs:
        if s.turn == 0:
            assert s.parent is None
            continue
        parent, reply = by_rid[s.parent]  # type: ignore[index]
        assert s.session == parent.session and s.turn == parent.turn + 1
        head = parent.prompt_ids + reply
        assert s.prompt_ids[: len(head)] == head
        assert len(s.prompt_ids) > len(head) + 10  # plus the next user turn
    # conversations share the system prompt, not more
    firsts = [s.prompt_ids for s, _ in reqs if s.turn == 0]
    shared = min(common_prefix_len(a, b) for a in firsts for b in firsts if a is not b)
    assert 40 <= shared < min(len(p) for p in firsts)


def test_chat_prompt_is_the_template_rendering_of_the_history(tiny_codec: Codec) -> None:
    for mode in ("incremental", "full"):
        reqs = build("chat", tiny_codec, chat_tokenize=mode)
        for s, _ in reqs:
            hist = s.state
            assert tiny_codec.decode(s.prompt_ids) == hist.rendered
            assert hist.rendered == tiny_codec.render_chat(hist.messages, add_generation_prompt=True)
            if s.turn:
                assert [m["role"] for m in hist.messages[-3:]] == ["user", "assistant", "user"]
        if mode == "full":
            assert all(tiny_codec.encode(s.state.rendered) == s.prompt_ids for s, _ in reqs)


def test_chat_follow_up_uses_the_given_reply(tiny_codec: Codec) -> None:
    w = make_workload(WorkloadParams(name="chat", **SMALL["chat"]), tiny_codec)  # type: ignore[arg-type]
    root = w.roots()[0]
    a = w.follow_ups(root, [300, 301, 302])[0]
    b = w.follow_ups(root, [400, 401])[0]
    assert a.prompt_ids[len(root.prompt_ids) : len(root.prompt_ids) + 3] == [300, 301, 302]
    assert b.prompt_ids[len(root.prompt_ids) : len(root.prompt_ids) + 2] == [400, 401]
    assert a.rid == b.rid == "chat-s0-t1"
    assert (
        a.prompt_ids[len(root.prompt_ids) + 3 :] == b.prompt_ids[len(root.prompt_ids) + 2 :]
    )  # same user turn
    assert a.delay_s == b.delay_s > 0
    assert w.follow_ups(a, [1])[0].turn == 2
    last = w.follow_ups(w.follow_ups(a, [1])[0], [1])
    assert last == []  # 3 turns


def test_agent_branches_share_their_trajectory(codec: Codec) -> None:
    reqs = build("agent", codec, branches=3, branch_at=1)
    by_rid = {s.rid: (s, r) for s, r in reqs}
    assert len(reqs) == 2 * (2 + 3 * 2)
    children: dict[str, list[RequestSpec]] = {}
    for s, _ in reqs:
        if s.parent:
            children.setdefault(s.parent, []).append(s)
    forks = {p: c for p, c in children.items() if len(c) > 1}
    assert len(forks) == 2 and all(len(c) == 3 for c in forks.values())
    for parent_rid, kids in children.items():
        parent, reply = by_rid[parent_rid]
        head = parent.prompt_ids + reply
        for k in kids:
            assert k.prompt_ids[: len(head)] == head  # grows by the model's own output ...
            assert len(k.prompt_ids) > len(head) + 10  # ... plus a tool result
        for i, a in enumerate(kids):
            for b in kids[i + 1 :]:
                assert common_prefix_len(a.prompt_ids, b.prompt_ids) < len(a.prompt_ids)
                assert a.branch != b.branch
    # a branch's descendants keep the fork's shared trajectory
    fork_parent = next(iter(forks))
    head = by_rid[fork_parent][0].prompt_ids + by_rid[fork_parent][1]
    leaves = [s for s, _ in reqs if s.turn == 3 and s.session == by_rid[fork_parent][0].session]
    assert len(leaves) == 3 and all(s.prompt_ids[: len(head)] == head for s in leaves)


def test_trace_workload(tmp_path: Path, tiny_codec: Codec) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"arrival_s": 0.5, "prompt": "Hello there, how are you?", "max_tokens": 3},
        {"arrival_s": 0.0, "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 2},
        {"arrival_s": 1.5, "messages": [{"role": "user", "content": "Hi"}], "session": "s1", "turn": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = make_workload(WorkloadParams(name="trace", trace=str(path), time_scale=2.0, output_len=5), tiny_codec)
    roots = w.roots()
    assert [r.arrival_s for r in roots] == [0.0, 1.0, 3.0]
    assert roots[0].prompt_ids == [5, 6, 7, 8] and roots[0].max_tokens == 2
    assert roots[1].prompt_ids == tiny_codec.encode("Hello there, how are you?")
    assert tiny_codec.decode(roots[2].prompt_ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert roots[2].max_tokens == 5 and roots[2].turn == 2 and roots[2].session == "s1"
    plan = plan_arrivals(roots, ArrivalParams(), seed=0)
    assert plan["mode"] == "trace" and plan["times"] == [0.0, 1.0, 3.0]
    with pytest.raises(ValueError, match="--trace"):
        make_workload(WorkloadParams(name="trace"), tiny_codec).roots()


def test_arrivals() -> None:
    roots = [RequestSpec(rid=str(i), prompt_ids=[1], max_tokens=1) for i in range(50)]
    a = plan_arrivals(roots, ArrivalParams(rate=10.0), seed=3)
    b = plan_arrivals(roots, ArrivalParams(rate=10.0), seed=3)
    assert a == b and a["mode"] == "poisson"
    times = a["times"]
    assert times[0] == 0.0 and all(x < y for x, y in zip(times, times[1:]))
    assert 2.0 < times[-1] < 10.0  # ~49 gaps of 0.1 s
    assert plan_arrivals(roots, ArrivalParams(rate=10.0), seed=4)["times"] != times
    assert plan_arrivals(roots, ArrivalParams(concurrency=3), seed=0)["concurrency"] == 3
    assert plan_arrivals(roots, ArrivalParams(), seed=0)["mode"] == "closed"


def test_synthetic_reply_and_codec() -> None:
    codec = SyntheticCodec()
    w = make_workload(WorkloadParams(name="random", num_requests=2), codec)
    spec = w.roots()[0]
    r = synthetic_reply(w, spec)
    assert len(r) == spec.max_tokens and r == synthetic_reply(w, spec)
    ids = codec.encode("<|im_start|>user\nHello world<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids and all(0 <= i < codec.vocab_size for i in ids)
    assert set(WORKLOADS) == {
        "chat",
        "shared-prefix",
        "prefix-repetition",
        "shifted-prefix",
        "agent",
        "random",
        "trace",
        *PRESSURE_WORKLOADS,
        *LARGE_WORKLOADS,
        *VARIANT_WORKLOADS,
    }
    assert Counter(workload_names("all")) == Counter(
        n
        for n in WORKLOADS
        if n != "trace" and n not in PRESSURE_WORKLOADS + LARGE_WORKLOADS + VARIANT_WORKLOADS
    )
    assert workload_names("pressure") == ["multi-turn", "swe-agent", "tree", "tenants"]


def test_multi_turn_resends_the_recorded_reply_not_the_models(codec: Codec) -> None:
    reqs = build("multi-turn", codec)
    by_rid = {s.rid: (s, r) for s, r in reqs}
    firsts = [s.prompt_ids for s, _ in reqs if s.turn == 0]
    assert len(firsts) == 3
    shared = min(common_prefix_len(a, b) for a in firsts for b in firsts if a is not b)
    assert shared >= 35  # the common prefix, then per-conversation prefixes
    assert all(2 <= sum(1 for s, _ in reqs if s.session == f"mt-s{i}") <= 4 for i in range(3))
    for s, _ in reqs:
        if s.parent is None:
            continue
        parent, reply = by_rid[s.parent]
        assert s.prompt_ids[: len(parent.prompt_ids)] == parent.prompt_ids
        # the next turn diverges right after the previous prompt: the model's reply is not in it
        assert s.prompt_ids[len(parent.prompt_ids) : len(parent.prompt_ids) + len(reply)] != reply
    model = build("multi-turn", codec, replies="model")
    by_rid = {s.rid: (s, r) for s, r in model}
    for s, _ in model:
        if s.parent is not None:
            parent, reply = by_rid[s.parent]
            assert s.prompt_ids[: len(parent.prompt_ids) + len(reply)] == parent.prompt_ids + reply


def test_swe_agent_re_sends_actions_and_has_heavy_tailed_observations(codec: Codec) -> None:
    reqs = build("swe-agent", codec, tool_len=200, turns=12, min_turns=12)
    by_rid = {s.rid: (s, r) for s, r in reqs}
    growth = []
    for s, _ in reqs:
        if s.parent is None:
            continue
        parent, reply = by_rid[s.parent]
        head = parent.prompt_ids + reply
        assert s.prompt_ids[: len(head)] == head  # the action comes back verbatim
        growth.append(len(s.prompt_ids) - len(head))
    assert max(growth) > 3 * sorted(growth)[len(growth) // 2]  # a heavy tail of observations
    stripped = build("swe-agent", codec, replies="stripped")
    by_rid = {s.rid: (s, r) for s, r in stripped}
    child = next(s for s, _ in stripped if s.parent is not None)
    parent, reply = by_rid[child.parent]  # type: ignore[index]
    tail = reply[len(reply) * 7 // 10 :]
    assert child.prompt_ids[len(parent.prompt_ids) : len(parent.prompt_ids) + len(tail)] == tail


def test_tree_siblings_share_the_parent_and_one_branch_goes_on(codec: Codec) -> None:
    w = make_workload(WorkloadParams(name="tree", **SMALL["tree"]), codec)  # type: ignore[arg-type]
    reqs = expand(w)
    assert len(reqs) == w.expected_requests() == 2 * (1 + 3 + 3)
    by_rid = {s.rid: (s, r) for s, r in reqs}
    kids: dict[str, list[RequestSpec]] = {}
    for s, _ in reqs:
        if s.parent:
            kids.setdefault(s.parent, []).append(s)
    assert all(len(k) == 3 for k in kids.values())
    for parent_rid, siblings in kids.items():
        parent, reply = by_rid[parent_rid]
        head = parent.prompt_ids + reply
        assert all(k.prompt_ids[: len(head)] == head for k in siblings)
        assert len({tuple(k.prompt_ids) for k in siblings}) == 3  # distinct proposals
        assert sum(1 for k in siblings if k.meta["expand"]) == 1


def test_tenants_volatile_first_line_splits_a_tenants_prefix(codec: Codec) -> None:
    reqs = [s for s, _ in build("tenants", codec) if s.turn == 0]
    by_tenant: dict[int, list[RequestSpec]] = {}
    for s in reqs:
        by_tenant.setdefault(s.meta["tenant"], []).append(s)
    assert len(by_tenant) >= 2
    for specs in by_tenant.values():
        for a in specs:
            for b in specs:
                if a is b:
                    continue
                n = common_prefix_len(a.prompt_ids, b.prompt_ids)
                if a.meta["epoch"] == b.meta["epoch"]:
                    assert n >= 50  # the same version of the system prompt
                else:
                    assert n < 40  # the timestamp differs: nothing past the first line is shared


def test_tenants_shift_moves_the_popular_tenant_each_phase(codec: Codec) -> None:
    kw = {"sessions": 400, "tenants": 8, "shift_every": 100, "shift_by": 3, "prefix_len": 20, "turns": 1}
    plain = [s for s, _ in build("tenants", codec, **kw) if s.turn == 0]
    shift = [s for s, _ in build("tenants-shift", codec, **kw) if s.turn == 0]
    assert "tenants-shift" in workload_names("tenants-shift") and "tenants-shift" not in workload_names("all")
    for phase in range(4):
        top = [
            Counter(s.meta["tenant"] for s in reqs[phase * 100 : phase * 100 + 100]).most_common(1)[0][0]
            for reqs in (plain, shift)
        ]
        assert top[0] == 0  # Zipf: the first tenant leads every phase of the plain workload
        assert top[1] == (3 * phase) % 8  # the shifted one's leader moves 3 ranks a phase


def test_mooncake_trace(tmp_path: Path, tiny_codec: Codec) -> None:
    path = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 700, "output_length": 3, "hash_ids": [0, 5]},
        {"timestamp": 700, "input_length": 1600, "output_length": 2, "hash_ids": [0, 1, 2, 9]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    w = make_workload(WorkloadParams(name="trace", trace=str(path)), tiny_codec)
    roots = w.roots()
    assert [r.arrival_s for r in roots] == [0.0, 0.7, 1.5]
    assert [len(r.prompt_ids) for r in roots] == [1100, 1600, 700]
    assert [r.max_tokens for r in roots] == [7, 2, 3]
    a, c, b = roots
    assert common_prefix_len(a.prompt_ids, c.prompt_ids) == 1100  # hash ids 0, 1, 2 shared
    assert common_prefix_len(a.prompt_ids, b.prompt_ids) == 512  # only hash id 0
    assert (
        a.prompt_ids
        == make_workload(WorkloadParams(name="trace", trace=str(path)), tiny_codec).roots()[0].prompt_ids
    )
    path.write_text(json.dumps({"timestamp": 0, "input_length": 10}))
    with pytest.raises(ValueError, match="needs prompt"):
        w.roots()
