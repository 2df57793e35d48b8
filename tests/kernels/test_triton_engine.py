"""The engine on the Triton ops == the engine on the reference ops (built-in tiny model, fp32).

The kernels composed as the model uses them: strided q/k/v views, decodes batched with prefill
segments, conv + GDN captures at chunk boundaries, checkpoint restores (``copy_state_slots``) on
a prefix-cache hit, paged attention over a cached prefix. Greedy tokens must be identical and the
sampled logits within tests/tolerances.py's CPU fp32 bound (std ~5; the kernels agree to ~1e-6
relative; measured under the interpreter: ~0.02 of that bound).

Runs under ``TRITON_INTERPRET=1`` on the CPU (~20 s) or on a CUDA device; skipped otherwise.
tests/engine/test_gpu_parity.py is the bigger GPU-only version (bf16 too).
"""

from __future__ import annotations

import random

import torch

from deltaserve.engine import EngineCore
from deltaserve.kernels import get_ops
from deltaserve.models import ensure_builtin_model, load_model
from tests.engine.conftest import greedy, make_config, record_logits, run_to_completion
from tests.kernels.triton_env import DEVICE, TRITON_MARKS
from tests.tolerances import assert_logits_close

pytestmark = TRITON_MARKS


def serve(backend: str) -> tuple[list[list[int]], list[torch.Tensor], dict[str, int]]:
    ops = get_ops(backend, DEVICE)
    loaded = load_model(ensure_builtin_model("tiny-qwen3.5"), dtype=torch.float32, device=DEVICE, ops=ops)
    core = EngineCore(
        make_config(**{"model.device": DEVICE, "kernels.backend": backend, "cache.checkpoint_interval": 64}),
        loaded=loaded,
    )
    logits_seen = record_logits(core)
    rng = random.Random(0)
    first = [[rng.randrange(3, core.vocab_size) for _ in range(n)] for n in (5, 70, 130, 1)]
    second = [first[2][:128] + [7, 8, 9]]  # restores the checkpoint captured at 128 tokens
    tokens: list[list[int]] = []
    for wave in (first, second):
        reqs = [core.make_request(p, greedy(4)) for p in wave]
        for r in reqs:
            core.add_request(r)
        outs = run_to_completion(core)
        tokens += [[t for o in outs[r.request_id] for t in o.token_ids] for r in reqs]
    return tokens, logits_seen, dict(core.counters)


def test_engine_on_triton_ops_matches_reference() -> None:
    ref_tokens, ref_logits, _ = serve("reference")
    tri_tokens, tri_logits, counters = serve("triton")
    assert counters["tokens.computed"] < counters["tokens.prompt"]  # the second wave hit the cache
    assert tri_tokens == ref_tokens
    assert len(tri_logits) == len(ref_logits)
    for step, (got, want) in enumerate(zip(tri_logits, ref_logits)):
        assert_logits_close(got, want, f"step {step}")
