"""Qwen3-Next (MoE hybrid) and Qwen3 (attention only: the plain-KV cache path) end to end."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from deltaserve.engine import EngineCore
from deltaserve.kernels import get_ops
from deltaserve.models import ensure_builtin_model, load_model
from tests.engine.conftest import greedy, hf_greedy, make_config, run_to_completion


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3"])
def test_builtin_model_through_engine_matches_transformers(name: str) -> None:
    from transformers import AutoModelForCausalLM

    path = ensure_builtin_model(name)
    loaded = load_model(path, dtype=torch.float32, device="cpu", ops=get_ops("reference"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(150)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(20 + 9 * i)] for i in range(4)]
    core = EngineCore(make_config(), loaded=loaded)
    has_gdn = core.spec.num_gdn_layers > 0
    assert has_gdn == (name == "tiny-qwen3-next")
    results: list[Any] = []
    for p in prompts:  # one after another so later prompts hit the shared prefix
        req = core.make_request(p, greedy(6))
        core.add_request(req)
        results.append(run_to_completion(core)[req.request_id])
    for p, outs in zip(prompts, results, strict=True):
        assert [t for o in outs for t in o.token_ids] == hf_greedy(hf, p, 6)
    hits = [outs[-1].num_cached_tokens for outs in results]
    if has_gdn:
        assert hits[0] == 0 and all(h >= 128 for h in hits[2:])  # branch checkpoint at 128
    else:
        assert hits[0] == 0 and all(h == 144 for h in hits[1:])  # plain KV: every full shared block
