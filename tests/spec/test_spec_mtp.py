"""The MTP drafter (``speculative.method = "mtp"``) on the built-in tiny model's head: greedy
outputs identical to speculation off (cache on and off, a multi-turn prefix hit), the pools
whole after every step, the head's KV allocated only for it, its drafts those a fresh prefill
of the same context proposes (so the head's KV, written step by step across verifies with
rejected positions, is the KV of the accepted tokens), and a model without a head refused."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.errors import ConfigError
from deltaserve.engine.spec.mtp import MtpDrafter
from deltaserve.kernels import get_ops
from deltaserve.models import LoadedModel, ensure_builtin_model, load_model
from deltaserve.scheduler.request import Request
from tests.engine.conftest import greedy, make_config, run_to_completion

MAX_TOKENS = 29
MTP = {"speculative.method": "mtp"}


@pytest.fixture(scope="module")
def mtp_loaded() -> LoadedModel:
    """The built-in tiny Qwen3.5 with its MTP head."""
    path = ensure_builtin_model("tiny-qwen3.5")
    return load_model(path, dtype=torch.float32, device="cpu", ops=get_ops("reference"), load_mtp=True)


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 1000) for _ in range(20)]
    return [shared + [rng.randrange(5, 1000) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


def _serve(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams, tag: str = "r"
) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(p, params, request_id=f"{tag}{i}"))
    outs = run_to_completion(core)  # integrity after every step; pools whole at the end
    return {rid: [t for o in os for t in o.token_ids] for rid, os in outs.items()}


def _spec(core: EngineCore) -> dict[str, float]:
    return {k: v for k, v in core.stats().items() if k.startswith("spec_decode.")}


def _assert_consistent(s: dict[str, float]) -> None:
    assert s["spec_decode.num_drafts"] > 0
    assert s["spec_decode.num_draft_tokens"] >= s["spec_decode.num_drafts"]
    assert 0 <= s["spec_decode.num_accepted_tokens"] <= s["spec_decode.num_draft_tokens"]
    assert (
        s["spec_decode.num_emitted_tokens"]
        == s["spec_decode.num_drafts"] + s["spec_decode.num_accepted_tokens"]
    )
    assert (
        sum(s[f"spec_decode.num_accepted_tokens_per_pos.{i}"] for i in range(3))
        == s["spec_decode.num_accepted_tokens"]
    )


@pytest.mark.parametrize("caching", [True, False])
def test_mtp_outputs_equal_speculation_off(mtp_loaded: LoadedModel, caching: bool) -> None:
    prompts = _prompts(0)
    off_core = EngineCore(make_config(**{"cache.enable_prefix_caching": caching}), loaded=mtp_loaded)
    off = _serve(off_core, prompts, greedy(MAX_TOKENS))
    core = EngineCore(make_config(**{"cache.enable_prefix_caching": caching}, **MTP), loaded=mtp_loaded)
    assert _serve(core, prompts, greedy(MAX_TOKENS)) == off
    _assert_consistent(_spec(core))
    # the head's KV layers exist only with method = "mtp"
    assert (off_core.spec.num_mtp_layers, core.spec.num_mtp_layers) == (0, 1)
    assert len(core.runner.caches.k_cache) == len(off_core.runner.caches.k_cache) + 1
    assert off_core.runner.mtp is None and core.runner.mtp is not None
    assert isinstance(core.speculation.drafter, MtpDrafter)  # type: ignore[union-attr]
    assert core.speculation.drafter.proposals == {}  # type: ignore[union-attr]  # every ending forgot its own


def test_mtp_multi_turn_prefix_hit(mtp_loaded: LoadedModel) -> None:
    prompts = _prompts(1, n=2)

    def two_turns(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        first = _serve(core, prompts, greedy(MAX_TOKENS), "a")
        follow = [p + first[f"a{i}"] + [7, 8, 9, 10, 11] for i, p in enumerate(prompts)]
        return first, _serve(core, follow, greedy(MAX_TOKENS), "b")

    off = two_turns(EngineCore(make_config(), loaded=mtp_loaded))
    core = EngineCore(make_config(**MTP), loaded=mtp_loaded)
    assert two_turns(core) == off
    assert core.stats()["prefix_cache.hit_tokens"] > 0
    _assert_consistent(_spec(core))


def test_mtp_drafts_match_a_fresh_prefill_of_the_context(mtp_loaded: LoadedModel) -> None:
    """The running engine's drafts after prefills and verifies (head KV written step by step,
    rejected positions overwritten, the prompt in chunks) are the drafts a fresh engine
    proposes right after prefilling the same context in one piece: the head pass keeps its KV
    exact."""
    prompt = [random.Random(2).randrange(5, 1000) for _ in range(100)]
    chunked = {"cache.enable_prefix_caching": False, "scheduler.max_num_batched_tokens": 64}
    core = EngineCore(make_config(**chunked, **MTP), loaded=mtp_loaded)  # the prompt in two chunks
    drafter = core.speculation.drafter  # type: ignore[union-attr]
    assert isinstance(drafter, MtpDrafter)
    core.add_request(core.make_request(prompt, greedy(MAX_TOKENS), request_id="r"))
    seen: list[tuple[list[int], list[int], torch.Tensor]] = []
    step = 0
    while core.has_work():
        core.step()
        core.check_integrity()
        req = next((r for r in core.scheduler.running if r.request_id == "r"), None)
        got = drafter.proposals.get("r")
        if req is not None and got is not None and got[0] == len(req.token_ids) and step % 3 == 0:
            seen.append((list(req.token_ids), got[1], _head_kv(core, req, len(req.token_ids) - 1)))
        step += 1
    assert len(seen) > 2
    for tokens, drafts, kv in seen:  # after the chunked prefill, then after verifies
        ref = EngineCore(make_config(**{"cache.enable_prefix_caching": False}, **MTP), loaded=mtp_loaded)
        ref.add_request(ref.make_request(tokens[:-1], greedy(2), request_id="x"))
        ref.step()  # the prefill: samples tokens[-1] (greedy) and drafts after it
        rdrafts = ref.speculation.drafter.proposals["x"]  # type: ignore[union-attr]
        assert rdrafts[0] == len(tokens)
        n = min(len(drafts), len(rdrafts[1]))
        assert n >= 1 and drafts[:n] == rdrafts[1][:n]
        # the head's KV of every computed position is the one-piece prefill's
        torch.testing.assert_close(
            kv, _head_kv(ref, ref.scheduler.running[0], len(tokens) - 1), atol=1e-4, rtol=1e-4
        )


def _head_kv(core: EngineCore, req: Request, n: int) -> torch.Tensor:
    """The MTP head's K and V of ``req``'s positions ``0 .. n - 1`` ``[2, n, heads, dim]``."""
    caches, bs = core.runner.caches, core.config.cache.block_size
    layer = core.spec.num_attn_layers  # the head's KV layer: after the target's
    table = req.cache.block_table  # type: ignore[union-attr]
    blocks = torch.tensor([table[p // bs] for p in range(n)])
    offs = torch.tensor([p % bs for p in range(n)])
    return torch.stack([caches.k_cache[layer][blocks, offs], caches.v_cache[layer][blocks, offs]])


def test_mtp_on_a_model_without_a_head_is_a_config_error(
    mtp_loaded: LoadedModel, tiny_loaded: LoadedModel
) -> None:
    path = ensure_builtin_model("tiny-qwen3")
    with pytest.raises(ConfigError) as e:
        EngineCore(make_config(**{"model.path": str(path)}, **MTP))
    assert str(e.value) == (
        f"speculative.method = 'mtp': {path}: model_type 'qwen3' has no multi-token-prediction head"
    )
    with pytest.raises(ConfigError) as e:
        EngineCore(make_config(**MTP), loaded=tiny_loaded)
    assert str(e.value) == (
        "speculative.method = 'mtp': the model was loaded without its MTP head (load_model(load_mtp=True))"
    )


def test_mtp_under_preemption_and_chunked_prefill(mtp_loaded: LoadedModel) -> None:
    """Prefill chunks (whose last row takes the next prompt token) and preempted, recomputed
    requests (whose proposals no longer match their token count) keep the outputs identical."""
    prompts = _prompts(3, n=5)
    small = {
        "cache.num_kv_blocks": 14,
        "cache.enable_prefix_caching": True,
        "scheduler.max_num_batched_tokens": 64,
    }
    off = _serve(EngineCore(make_config(**small), loaded=mtp_loaded), prompts, greedy(MAX_TOKENS))
    core = EngineCore(make_config(**small, **MTP), loaded=mtp_loaded)
    assert _serve(core, prompts, greedy(MAX_TOKENS)) == off
    assert core.stats()["scheduler.preemptions"] > 0
    _assert_consistent(_spec(core))
