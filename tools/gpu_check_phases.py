"""The in-process phases of ``tools/gpu_check.py``: engine parity on the device against the CPU
reference engine, and speed against rooflines measured in the same run.

Each phase takes a ``Plan`` (shapes and sizes: tiny on a dry run, real shapes on a GPU) and
returns a JSON-able dict; a phase never raises for a failed check (``ok: False`` and the
reason), so one failure does not hide the others. Timings synchronize the device around each
measured region (CUDA work is asynchronous).
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.engine import EngineCore
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.constraint import Constraint, ConstraintKind
from deltaserve.engine.sampling_params import SamplingParams

#: a schema whose every completion is short (a bool and a two-way enum), so a random-weight
#: model finishes it well inside max_tokens
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["a", "b"]}},
    "required": ["ok", "c"],
    "additionalProperties": False,
}


@dataclass
class Plan:
    """What the phases run: ``device`` / ``dtype`` for the measured engine, the model folder for
    parity and for speed, and the sizes."""

    device: str
    dtype: str
    parity_model: str
    speed_model: str
    backend: str
    parity_lengths: list[int]
    parity_tokens: int
    decode_batches: list[int]
    decode_steps: int
    prefill_lengths: list[int]
    ttft_prefix: int
    copy_bytes: int
    matmul_n: int
    memory_bytes: int


def free() -> None:
    """Give the device memory of engines already dropped back, so the next engine's capacity
    planning sees it free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine(plan: Plan, model: str, **dotted: Any) -> EngineCore:
    base: dict[str, Any] = {
        "model.path": model,
        "model.device": plan.device,
        "model.dtype": plan.dtype,
        "kernels.backend": plan.backend,
        # a fixed cache on CUDA too: an engine's size must not depend on what earlier engines
        # of this process still hold when it plans its capacity
        "cache.memory_bytes": plan.memory_bytes,
        "scheduler.max_num_seqs": max(plan.decode_batches),
        "scheduler.max_num_batched_tokens": 2048,
        "logging.level": "warning",
        "logging.stats_interval_s": 0.0,
    }
    base.update(dotted)
    free()  # engines of finished phases (json_request's, ttft's) are garbage by now
    return EngineCore(EngineConfig.load(None, base))


def drain(core: EngineCore, max_steps: int = 100_000) -> dict[str, list[Any]]:
    outs: dict[str, list[Any]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def serve_greedy(core: EngineCore, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    reqs = [
        core.make_request(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        for p in prompts
    ]
    for r in reqs:
        core.add_request(r)
    outs = drain(core)
    return [[t for o in outs[r.request_id] for t in o.token_ids] for r in reqs]


def parity(plan: Plan) -> dict[str, Any]:
    """Greedy tokens of the device engine == the CPU float32 reference engine's (float32 on
    the device: exact agreement expected; in ``plan.dtype`` when it is lower: the share of
    matching tokens is reported, bf16 rounding may flip near-ties); prefix cache on == off on
    the device; a json_schema request's output parses and meets the schema."""
    rng = random.Random(0)
    ref = engine(
        plan,
        plan.parity_model,
        **{"model.device": "cpu", "model.dtype": "float32", "kernels.backend": "reference"},
    )
    vocab = min(ref.vocab_size, 250)  # ids the byte-level tokenizer owns
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in plan.parity_lengths]
    ref_tokens = serve_greedy(ref, prompts, plan.parity_tokens)
    ref.close()
    del ref
    free()
    out: dict[str, Any] = {"prompts": len(prompts), "tokens_each": plan.parity_tokens}
    dev32 = engine(plan, plan.parity_model, **{"model.dtype": "float32"})
    dev_tokens = serve_greedy(dev32, prompts, plan.parity_tokens)
    out["fp32_tokens_equal"] = dev_tokens == ref_tokens
    out["fp32_token_match"] = match(dev_tokens, ref_tokens)
    dev32.close()
    del dev32
    free()
    # a bfloat16 recurrent state (``model.ssm_state_dtype``): reported only, its rounding may
    # flip near-ties as a bf16 model dtype does
    b16 = engine(plan, plan.parity_model, **{"model.dtype": "float32", "model.ssm_state_dtype": "bfloat16"})
    out["bf16_state_token_match"] = match(serve_greedy(b16, prompts, plan.parity_tokens), ref_tokens)
    b16.close()
    del b16
    free()
    if plan.dtype != "float32":
        low = engine(plan, plan.parity_model)
        low_tokens = serve_greedy(low, prompts, plan.parity_tokens)
        same = sum(
            a == b for x, y in zip(low_tokens, ref_tokens, strict=True) for a, b in zip(x, y, strict=True)
        )
        out[f"{plan.dtype}_token_match"] = same / max(1, sum(map(len, ref_tokens)))
        low.close()
        del low
        free()
    # prefix cache on vs off: the second wave continues the first (hits when on)
    waves = [prompts, [p + [7, 8, 9] for p in prompts]]
    results = []
    for on in (True, False):
        core = engine(plan, plan.parity_model, **{"cache.enable_prefix_caching": on})
        results.append([serve_greedy(core, w, plan.parity_tokens) for w in waves])
        core.close()
        del core
        free()
    out["prefix_cache_on_off_equal"] = results[0] == results[1]
    out["json_schema"] = json_request(plan)
    out["ok"] = bool(
        out["fp32_tokens_equal"] and out["prefix_cache_on_off_equal"] and out["json_schema"]["ok"]
    )
    return out


def match(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of ``want``'s tokens that ``got`` has at the same place."""
    same = sum(a == b for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=False))
    return same / max(1, sum(map(len, want)))


def json_request(plan: Plan) -> dict[str, Any]:
    core = engine(plan, plan.parity_model)
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(SCHEMA))
    req = core.make_request("JSON:", SamplingParams(max_tokens=64, temperature=0.0, constraint=constraint))
    core.add_request(req)
    outs = drain(core)[req.request_id]
    # the core emits token ids only (the front end detokenizes): decode the whole reply once
    text = core.tokenizer.decode([t for o in outs for t in o.token_ids], skip_special_tokens=True)
    try:
        value = json.loads(text)
        ok = set(value) == {"ok", "c"} and isinstance(value["ok"], bool) and value["c"] in ("a", "b")
    except ValueError:
        ok = False
    core.close()
    return {"ok": ok, "text": text, "finished": bool(outs and outs[-1].finish_reason is not None)}


def timed(device: str, fn: Callable[[], Any], repeat: int = 3) -> float:
    """The best of ``repeat`` timings of ``fn`` (after one warm-up), in seconds."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def rooflines(plan: Plan) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written per second, a device-to-device copy) and matmul
    FLOP/s in ``plan.dtype``, measured here so the speed phase compares against this card."""
    dtype = getattr(torch, plan.dtype)
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    copy_s = timed(plan.device, copy)
    n = plan.matmul_n
    a = torch.randn(n, n, dtype=dtype, device=plan.device)
    b = torch.randn(n, n, dtype=dtype, device=plan.device)

    def matmul() -> None:
        torch.matmul(a, b)

    mm_s = timed(plan.device, matmul)
    return {"copy_bytes_per_s": 2 * plan.copy_bytes / copy_s, "matmul_flop_per_s": 2 * n**3 / mm_s}


def weight_bytes(core: EngineCore) -> int:
    return sum(p.numel() * p.element_size() for p in core.runner.model.parameters())


def decode_speed(
    plan: Plan, core: EngineCore, roof: dict[str, Any], remaining: Callable[[], float]
) -> list[dict[str, Any]]:
    """Output tok/s at each batch size once every request is decoding, against the weight
    streaming bound (weight bytes per step over the copy bandwidth; KV reads not counted, so
    the bound is optimistic at long contexts)."""
    rows = []
    wbytes = weight_bytes(core)
    step_floor_s = wbytes / roof["copy_bytes_per_s"]
    rng = random.Random(1)
    for batch in plan.decode_batches:
        if remaining() < 20:
            rows.append({"batch": batch, "skipped": "budget"})
            continue
        prompts = [[rng.randrange(3, 250) for _ in range(16)] for _ in range(batch)]
        total = plan.decode_steps + 4
        reqs = [
            core.make_request(p, SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True))
            for p in prompts
        ]
        for r in reqs:
            core.add_request(r)
        # prefill and the first decodes off the clock: every request decoding from here on
        seen = dict.fromkeys((r.request_id for r in reqs), 0)
        while core.has_work() and min(seen.values()) < 2:
            for o in core.step():
                seen[o.request_id] = seen.get(o.request_id, 0) + len(o.token_ids)
        sync(plan.device)
        t = time.perf_counter()
        produced = 0
        for _ in range(plan.decode_steps):
            produced += sum(len(o.token_ids) for o in core.step())
        sync(plan.device)
        elapsed = time.perf_counter() - t
        drain(core)
        rate = produced / elapsed
        roof_rate = batch / step_floor_s
        rows.append({
            "batch": batch,
            "tok_per_s": rate,
            "step_ms": 1000 * elapsed / plan.decode_steps,
            "roofline_tok_per_s": roof_rate,
            "of_roofline": rate / roof_rate,
        })  # fmt: skip
    return rows


#: the profiler's names of a kernel launch (torch's and Triton's) and of a host-device sync
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cuLaunchKernel")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


def decode_profile(plan: Plan, core: EngineCore, steps: int = 4) -> dict[str, Any]:
    """Where a batch-1 decode step goes (``torch.profiler``), per step: kernel launches, host
    syncs, torch ops, CPU time of the ops and device time of the kernels. On the CPU (a dry run)
    only the torch ops and their time are counted."""
    from torch.profiler import ProfilerActivity, profile

    cuda = plan.device.startswith("cuda")
    req = core.make_request(
        [3, 4, 5, 6], SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    )
    core.add_request(req)
    for _ in range(3):  # the prefill and the first decodes off the record
        core.step()
    sync(plan.device)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            core.step()
        sync(plan.device)
    drain(core)
    events = prof.key_averages()
    count = lambda names: sum(e.count for e in events if e.key in names)  # noqa: E731
    ops = [e for e in events if e.key.startswith("aten::")]
    out = {
        "steps": steps,
        "launches_per_step": count(LAUNCHES) / steps,
        "syncs_per_step": count(SYNCS) / steps,
        "aten_ops_per_step": sum(e.count for e in ops) / steps,
        "cpu_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1000 / steps,
        "top_ops": sorted(((e.key, e.count // steps) for e in ops), key=lambda kv: -kv[1])[:12],
    }
    if cuda:
        out["device_ms_per_step"] = (
            sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000 / steps
        )
    return out


def prefill_speed(
    plan: Plan, core: EngineCore, roof: dict[str, Any], remaining: Callable[[], float]
) -> list[dict[str, Any]]:
    """Prompt tok/s of one request of each length (cache off: all computed) against the matmul
    bound 2 x weight params FLOPs per token (attention's quadratic term not counted)."""
    rows = []
    params = sum(p.numel() for p in core.runner.model.parameters())
    rng = random.Random(2)
    for n in plan.prefill_lengths:
        if remaining() < 20:
            rows.append({"tokens": n, "skipped": "budget"})
            continue
        prompt = [rng.randrange(3, 250) for _ in range(n)]
        # warm-up at the measured length (another prompt: no hit): the chunk kernels compile a
        # variant per shape they first meet, which a short warm-up left inside the timing
        serve_greedy(core, [[rng.randrange(3, 250) for _ in range(n)]], 1)
        sync(plan.device)
        t = time.perf_counter()
        serve_greedy(core, [prompt], 1)
        sync(plan.device)
        elapsed = time.perf_counter() - t
        rate = n / elapsed
        roof_rate = roof["matmul_flop_per_s"] / (2 * params)
        rows.append(
            {"tokens": n, "tok_per_s": rate, "roofline_tok_per_s": roof_rate, "of_roofline": rate / roof_rate}
        )
    return rows


def ttft(plan: Plan) -> dict[str, Any]:
    """Time to first token of a request on a ``ttft_prefix``-token prompt (cold), then of one
    sharing that prefix with a new 16-token tail (warm: served from the prefix cache)."""
    core = engine(plan, plan.speed_model, **{"cache.enable_prefix_caching": True})
    rng = random.Random(3)
    prefix = [rng.randrange(3, 250) for _ in range(plan.ttft_prefix)]
    serve_greedy(core, [[5] * 32], 1)  # first-use costs (kernel compiles) off the clock

    def first_token(prompt: list[int]) -> float:
        req = core.make_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        core.add_request(req)
        sync(plan.device)
        t = time.perf_counter()
        while not any(o.request_id == req.request_id and o.token_ids for o in core.step()):
            pass
        sync(plan.device)
        elapsed = time.perf_counter() - t
        drain(core)
        return elapsed

    cold = first_token(prefix + [rng.randrange(3, 250) for _ in range(16)])
    warm = first_token(prefix + [rng.randrange(3, 250) for _ in range(16)])
    return {"prefix_tokens": plan.ttft_prefix, "cold_s": cold, "warm_s": warm, "speedup": cold / warm}
