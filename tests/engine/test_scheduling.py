"""Scheduling end to end: preemption keeps outputs exact; long prefills never stall decodes."""

from __future__ import annotations

import random
from typing import Any

from tests.engine.conftest import greedy, run_to_completion


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_preemption_32_concurrent_outputs_identical(core_factory: Any) -> None:
    rng = random.Random(0)
    prompts = [rand_prompt(rng, rng.randrange(20, 140)) for _ in range(32)]

    def serve(core: Any) -> dict[int, list[int]]:
        reqs = [core.make_request(p, greedy(16)) for p in prompts]
        for r in reqs:
            core.add_request(r)
        outs = run_to_completion(core)  # integrity checked after every step
        for r in reqs:
            assert outs[r.request_id][-1].finish_reason == "length"
        return {i: [t for o in outs[r.request_id] for t in o.token_ids] for i, r in enumerate(reqs)}

    roomy = core_factory(**{"scheduler.max_num_seqs": 32, "cache.enable_prefix_caching": False})
    tight = core_factory(**{"scheduler.max_num_seqs": 32, "cache.num_kv_blocks": 40})
    assert serve(tight) == serve(roomy)
    assert tight.stats()["scheduler.preemptions"] > 0
    assert roomy.stats()["scheduler.preemptions"] == 0


def test_long_prompt_does_not_stall_running_decodes(core_factory: Any) -> None:
    rng = random.Random(1)
    core = core_factory(
        **{"scheduler.max_num_batched_tokens": 512, "scheduler.max_num_seqs": 16, "cache.num_kv_blocks": 1024}
    )
    decoders = [core.make_request(rand_prompt(rng, 30), greedy(40)) for _ in range(8)]
    for r in decoders:
        core.add_request(r)
    while not all(r.is_decoding for r in decoders):
        core.step()
    long = core.make_request(rand_prompt(rng, 4000), greedy(2))
    core.add_request(long)
    steps = 0
    while long.num_computed_tokens < 4000:
        outs = core.step()
        core.check_integrity()
        steps += 1
        emitted = {o.request_id for o in outs}
        assert {r.request_id for r in decoders} <= emitted, f"step {steps}: a decode was stalled"
    assert steps >= 4000 // 512
    run_to_completion(core)


def test_policy_from_config_file_and_set_changes_engine_order(core_factory: Any, tmp_path: Any) -> None:
    import argparse

    from deltaserve.engine import EngineCore
    from deltaserve.engine.cli import add_config_args, config_from_args

    (tmp_path / "sjf.toml").write_text(
        '[scheduler]\npolicy = "sjf"\nmax_num_seqs = 1\n[cache]\nnum_kv_blocks = 256\n'
    )
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    loaded = core_factory().loaded
    rng = random.Random(2)
    long_p, short_p = rand_prompt(rng, 300), rand_prompt(rng, 20)

    finish_step: dict[str, int] = {}

    def run(argv: list[str]) -> str:
        core = EngineCore(config_from_args(parser.parse_args(argv)), loaded=loaded)
        core.add_request(core.make_request(long_p, greedy(2), request_id="long"))
        core.add_request(core.make_request(short_p, greedy(2), request_id="short"))
        step = 0
        while core.has_work():
            step += 1
            for o in core.step():
                if o.finished:
                    finish_step[o.request_id] = step
            core.check_integrity()
        return min(("long", "short"), key=lambda r: finish_step[r])

    assert run(["--config", str(tmp_path / "sjf.toml")]) == "short"
    assert run(["--config", str(tmp_path / "sjf.toml"), "--set", "scheduler.policy=fcfs"]) == "long"
    custom = "scheduler.policy=tests.scheduler.custom_policy:LongestFirst"
    assert run(["--config", str(tmp_path / "sjf.toml"), "--set", custom]) == "long"


def test_without_chunked_prefill_a_prompt_is_one_step(core_factory: Any) -> None:
    rng = random.Random(3)
    chunked = core_factory(**{"scheduler.max_num_batched_tokens": 256})
    whole = core_factory(
        **{"scheduler.max_num_batched_tokens": 256, "scheduler.enable_chunked_prefill": False}
    )
    p = rand_prompt(rng, 1000)
    outs = {}
    for name, core in (("chunked", chunked), ("whole", whole)):
        req = core.make_request(p, greedy(3))
        core.add_request(req)
        steps = 0
        while req.num_computed_tokens < 1000:
            core.step()
            steps += 1
        outs[name] = (steps, [t for o in run_to_completion(core)[req.request_id] for t in o.token_ids])
    assert outs["whole"][0] == 1 and outs["chunked"][0] == 4
    assert outs["whole"][1][1:] == outs["chunked"][1][1:]
