"""Shared fixtures: the built-in tiny model (ours and transformers'), engine factories."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from deltaserve.engine import EngineConfig, EngineCore, SamplingParams
from deltaserve.kernels import get_ops
from deltaserve.models import LoadedModel, ensure_builtin_model, load_model


@pytest.fixture(scope="session")
def tiny_path() -> Any:
    return ensure_builtin_model("tiny-qwen3.5")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_path: Any) -> LoadedModel:
    return load_model(tiny_path, dtype=torch.float32, device="cpu", ops=get_ops("reference"))


@pytest.fixture(scope="session")
def hf_tiny(tiny_path: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    return model.eval()


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, one prompt at a time, EOS ignored."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def make_config(**dotted: Any) -> EngineConfig:
    base: dict[str, Any] = {
        # the CPU in float32 whatever the machine has (the defaults are auto: CUDA when there
        # is one), so the engine tests compare the same thing on a GPU box
        "model.device": "cpu",
        "model.dtype": "float32",
        "scheduler.max_num_batched_tokens": 256,
        "scheduler.max_num_seqs": 8,
        "cache.num_kv_blocks": 512,
        "cache.memory_bytes": 256 * 1024**2,
        "logging.stats_interval_s": 60.0,
    }
    base.update(dotted)
    return EngineConfig.load(None, base)


@pytest.fixture
def core_factory(tiny_loaded: LoadedModel) -> Callable[..., EngineCore]:
    def make(**dotted: Any) -> EngineCore:
        return EngineCore(make_config(**dotted), loaded=tiny_loaded)

    return make


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[Any]]:
    """Step until idle, checking integrity after every step; outputs by request id."""
    outs: dict[str, list[Any]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
        core.check_integrity()
    assert not core.has_work(), "engine did not drain"
    on_device = sum(1 for n in core.cache.tree.nodes() if n.block_id >= 0)  # host-tier nodes aside
    assert core.cache.blocks.num_free + on_device == core.cache.blocks.num_blocks
    assert core.cache.slots.num_free_live == core.cache.slots.num_live
    return outs


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def record_logits(core: EngineCore) -> list[torch.Tensor]:
    """Wrap ``core``'s forward so that every step's logits (the rows to sample: every
    sampling path starts from them) are appended, as float on the CPU, to the list returned."""
    seen: list[torch.Tensor] = []
    forward = core.runner.model.forward

    def recording_forward(batch: Any, caches: Any) -> torch.Tensor:
        logits = forward(batch, caches)
        if logits.shape[0]:
            seen.append(logits.float().cpu())
        return logits

    core.runner.model.forward = recording_forward  # type: ignore[method-assign]
    return seen


def separate(config: EngineConfig) -> EngineConfig:
    """``config`` with the engine core in a process of its own (``engine.core_process``)."""
    return config.replace(**{"engine.core_process": "separate"})
