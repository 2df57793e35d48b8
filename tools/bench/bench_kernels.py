"""Kernel micro-benchmarks: the reference (PyTorch) ops vs the Triton ops, side by side.

Shapes are Qwen3.5-0.8B-like (bf16): GDN with 16 key / 16 value heads of dim 128 and a width-4
short conv over ``conv_dim = 6144`` channels; full attention with 8 query / 2 KV heads of dim 256
on 16-token pages. Cases: decode steps at batch 1 / 32 / 128 (``--context`` tokens of context
each), one ``--prefill``-token prompt, and a checkpoint restore copy over all GDN layers' states.

For the decode-step kernels (and the copy) the table also shows the achieved memory bandwidth of
the Triton op (bytes it must move / time) and that as a fraction of ``--peak-gbps`` (default:
H100 SXM HBM3, 3350 GB/s).

    python tools/bench/bench_kernels.py                      # needs CUDA; says so and exits 0 otherwise
    python tools/bench/bench_kernels.py --interpret          # tiny shapes, Triton interpreter, on the CPU

Timing: the backends of a case run as ``--rounds`` interleaved rounds (``harness.interleaved``),
each round one ``triton.testing.do_bench`` (median, L2 flushed between runs) on CUDA, or one call
under the interpreter after a warm-up round (only a smoke test: interpreter times mean nothing);
the table shows the median round, ``--json`` adds each backend's spread.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, spread, timed

Thunk = Callable[[], object]


@dataclass(frozen=True)
class Shapes:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_gdn_layers: int
    decode_batches: tuple[int, ...]
    context: int
    prefill: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def dims(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        """(k heads, v heads, k dim, v dim, conv dim, conv kernel; q heads, KV heads, head dim, block size)."""
        return (
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.conv_dim, self.conv_kernel,
            self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size,
        )  # fmt: skip


QWEN35_08B = Shapes(16, 16, 128, 128, 4, 8, 2, 256, 16, 18, (1, 32, 128), 4096, 4096)
TINY = Shapes(2, 4, 16, 16, 4, 4, 2, 16, 16, 2, (1, 4), 64, 96)


@dataclass
class Case:
    op: str
    shape: str
    setup: Callable[[object], Thunk]  # ops -> a thunk running the op once on fresh inputs
    nbytes: int | None  # bytes the op must move (None: not a bandwidth-bound case)


class _Inputs:
    """Fresh random inputs on the device, all from one seeded CPU generator."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.device = device
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def randn(self, *shape: int, scale: float = 1.0, dt: torch.dtype | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(self.device, dt or self.dtype)

    def idx(self, values: list[int] | range) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)


def _decode_cases(s: Shapes, inp: _Inputs, n: int) -> list[Case]:
    """One decode step of ``n`` sequences: GDN recurrence, conv update, paged attention over
    ``s.context`` tokens each, KV store."""
    device, dtype, randn, idx, itemsize = inp.device, inp.dtype, inp.randn, inp.idx, inp.itemsize
    hk, hv, dk, dv, cdim, kw, hq, hkv, hd, bs = s.dims
    slots = idx(range(n))
    cases: list[Case] = []

    def gdn_decode(ops: object) -> Thunk:
        q, k, v = randn(n, hk, dk), randn(n, hk, dk), randn(n, hv, dv)
        g, beta = -torch.rand(n, hv, device=device), torch.rand(n, hv, device=device).to(dtype)
        ssm = randn(n, hv, dk, dv, scale=0.1, dt=torch.float32)
        return lambda: ops.recurrent_gated_delta_rule(q, k, v, g, beta, ssm, slots)

    state_bytes = n * hv * dk * dv * 4 * 2
    io_bytes = n * (2 * hk * dk + 2 * hv * dv) * itemsize + n * hv * (4 + itemsize)
    cases.append(Case("recurrent_gated_delta_rule", f"decode B={n}", gdn_decode, state_bytes + io_bytes))

    def conv_decode(ops: object) -> Thunk:
        x, w, state = randn(n, cdim), randn(cdim, kw), randn(n, cdim, kw - 1)
        return lambda: ops.causal_conv1d_update(x, w, None, state, slots)

    conv_bytes = (n * cdim * (kw - 1) * 2 + 2 * n * cdim + cdim * kw) * itemsize
    cases.append(Case("causal_conv1d_update", f"decode B={n}", conv_decode, conv_bytes))

    blocks_per_seq = -(-s.context // bs)

    def attn_decode(ops: object) -> Thunk:
        k_cache = randn(n * blocks_per_seq, bs, hkv, hd)
        v_cache = randn(n * blocks_per_seq, bs, hkv, hd)
        tables = idx(range(n * blocks_per_seq)).view(n, blocks_per_seq)
        q = randn(n, hq, hd)
        cu, lens = idx(range(n + 1)), idx([s.context] * n)
        return lambda: ops.paged_attention(q, k_cache, v_cache, tables, cu, lens, hd**-0.5)

    kv_bytes = 2 * n * s.context * hkv * hd * itemsize + 2 * n * hq * hd * itemsize
    cases.append(Case("paged_attention", f"decode B={n} ctx={s.context}", attn_decode, kv_bytes))

    def kv_store(ops: object) -> Thunk:
        key, value = randn(n, hkv, hd), randn(n, hkv, hd)
        k_cache, v_cache = randn(n + 1, bs, hkv, hd), randn(n + 1, bs, hkv, hd)
        slot_mapping = idx([b * bs for b in range(n)])
        return lambda: ops.store_kv(key, value, k_cache, v_cache, slot_mapping)

    cases.append(Case("store_kv", f"decode B={n}", kv_store, 4 * n * hkv * hd * itemsize))
    return cases


def _prefill_cases(s: Shapes, inp: _Inputs) -> list[Case]:
    """One ``s.prefill``-token prompt, capturing states every 2048 tokens (64 on tiny shapes)."""
    device, dtype, randn, idx = inp.device, inp.dtype, inp.randn, inp.idx
    hk, hv, dk, dv, cdim, kw, hq, hkv, hd, bs = s.dims
    t = s.prefill
    cu = idx([0, t])
    captures = list(range(64, t + 1, 2048 if t > 2048 else 64))
    num_blocks = -(-t // bs)
    cases: list[Case] = []

    def capture_args(positions: list[int] = captures) -> dict[str, torch.Tensor]:
        return {"capture_seq": idx([0] * len(positions)), "capture_pos": idx(positions),
                "capture_slots": idx(range(1, 1 + len(positions)))}  # fmt: skip

    def gdn_prefill(ops: object, positions: list[int] = captures) -> Thunk:
        q, k, v = randn(t, hk, dk), randn(t, hk, dk), randn(t, hv, dv)
        g, beta = -torch.rand(t, hv, device=device) * 0.3, torch.rand(t, hv, device=device).to(dtype)
        ssm = torch.zeros(1 + len(positions), hv, dk, dv, device=device)
        cap = capture_args(positions)
        return lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, cu, ssm, idx([0]), idx([0]).bool(), **cap)

    cases.append(Case("chunk_gated_delta_rule", f"prefill T={t}", gdn_prefill, None))
    # the same captures one block earlier: off the 64-token chunk grid, each pads one partial chunk
    off_grid = [max(p - bs, 1) for p in captures]
    cases.append(
        Case(
            "chunk_gated_delta_rule",
            f"prefill T={t}, captures off-grid",
            lambda o: gdn_prefill(o, off_grid),
            None,
        )
    )

    def conv_prefill(ops: object) -> Thunk:
        x, w, state = randn(t, cdim), randn(cdim, kw), randn(1 + len(captures), cdim, kw - 1)
        cap = capture_args()
        return lambda: ops.causal_conv1d_varlen(x, w, None, cu, state, idx([0]), idx([0]).bool(), **cap)

    cases.append(Case("causal_conv1d_varlen", f"prefill T={t}", conv_prefill, None))

    def attn_prefill(ops: object) -> Thunk:
        k_cache, v_cache = randn(num_blocks, bs, hkv, hd), randn(num_blocks, bs, hkv, hd)
        q = randn(t, hq, hd)
        return lambda: ops.paged_attention(
            q, k_cache, v_cache, idx(range(num_blocks))[None], cu, idx([t]), hd**-0.5
        )

    cases.append(Case("paged_attention", f"prefill T={t}", attn_prefill, None))

    def kv_store_prefill(ops: object) -> Thunk:
        key, value = randn(t, hkv, hd), randn(t, hkv, hd)
        k_cache, v_cache = randn(num_blocks, bs, hkv, hd), randn(num_blocks, bs, hkv, hd)
        return lambda: ops.store_kv(key, value, k_cache, v_cache, idx(range(t)))

    cases.append(Case("store_kv", f"prefill T={t}", kv_store_prefill, 4 * t * hkv * hd * inp.itemsize))
    return cases


def _restore_case(s: Shapes, inp: _Inputs, pairs: int = 4) -> Case:
    """A checkpoint restore: ``pairs`` slot copies over every GDN layer's conv and SSM state."""
    hv, dk, dv, cdim, kw = s.num_v_heads, s.head_k_dim, s.head_v_dim, s.conv_dim, s.conv_kernel
    num_slots = 2 * pairs

    def restore(ops: object) -> Thunk:
        tensors = [inp.randn(num_slots, cdim, kw - 1) for _ in range(s.num_gdn_layers)]
        tensors += [inp.randn(num_slots, hv, dk, dv, dt=torch.float32) for _ in range(s.num_gdn_layers)]
        src, dst = inp.idx(range(pairs, 2 * pairs)), inp.idx(range(pairs))
        return lambda: ops.copy_state_slots(tensors, src, dst)

    slot_bytes = s.num_gdn_layers * (cdim * (kw - 1) * inp.itemsize + hv * dk * dv * 4)
    shape = f"{pairs} slots x {2 * s.num_gdn_layers} tensors"
    return Case("copy_state_slots", shape, restore, 2 * pairs * slot_bytes)


def _cases(s: Shapes, device: torch.device, dtype: torch.dtype) -> list[Case]:
    inp = _Inputs(device, dtype)
    cases = [c for n in s.decode_batches for c in _decode_cases(s, inp, n)]
    return cases + _prefill_cases(s, inp) + [_restore_case(s, inp)]


def _timer(thunk: Thunk, device: torch.device) -> Callable[[], float]:
    """One round's measure of ``thunk`` in milliseconds."""
    if device.type == "cuda":
        import triton.testing

        return lambda: float(triton.testing.do_bench(thunk, warmup=10, rep=50, return_mode="median"))
    return lambda: timed(thunk)[0] * 1e3


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, rounds=3)
    parser.add_argument(
        "--peak-gbps", type=float, default=3350.0, help="GPU peak memory bandwidth (default: H100 SXM)"
    )
    parser.add_argument(
        "--interpret", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--context", type=int, default=None, help="decode context length (tokens)")
    parser.add_argument("--prefill", type=int, default=None, help="prefill length (tokens)")
    parser.add_argument("--skip-reference", action="store_true", help="time only the Triton ops")
    return parser


def _row(
    case: Case, backends: dict[str, object], device: torch.device, peak_gbps: float, rounds: int
) -> tuple[str, dict[str, dict[str, float]]]:
    """One case timed on every backend (interleaved rounds): the table row (median times,
    speedup, the Triton op's bandwidth) and each backend's spread in ms."""
    cases = {b: _timer(case.setup(ops), device) for b, ops in backends.items()}
    ms = {b: spread(t) for b, t in interleaved(cases, rounds, warmup=device.type != "cuda").items()}
    tri, ref = ms["triton"]["median"], ms["reference"]["median"] if "reference" in ms else None
    speedup = f"{ref / tri:7.1f}x" if ref else ""
    bw = pct = ""
    if case.nbytes is not None:
        gbps = case.nbytes / (tri * 1e-3) / 1e9
        bw, pct = f"{gbps:8.1f}", f"{100 * gbps / peak_gbps:6.1f}%"
    ref_s = f"{ref:13.3f}" if ref is not None else f"{'-':>13s}"
    return f"{case.op:28s} {case.shape:26s} {ref_s} {tri:10.3f} {speedup:>8s} {bw:>8s} {pct:>7s}", ms


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bench = Bench("bench_kernels", args)

    if args.interpret:
        # Must precede the first import of the Triton kernels (triton.jit reads it at decoration).
        os.environ["TRITON_INTERPRET"] = "1"
        device, shapes = torch.device("cpu"), TINY
    elif torch.cuda.is_available():
        device, shapes = torch.device("cuda"), QWEN35_08B
    else:
        print("bench_kernels: no CUDA device here, nothing to benchmark (use --interpret for a tiny-shape smoke "
              "run of the Triton kernels under the interpreter on the CPU).")  # fmt: skip
        return 0
    if args.context or args.prefill:
        shapes = Shapes(**{**shapes.__dict__, "context": args.context or shapes.context,
                           "prefill": args.prefill or shapes.prefill})  # fmt: skip

    from deltaserve.kernels import get_ops

    backends = {"triton": get_ops("triton", device)}
    if not args.skip_reference:
        backends = {"reference": get_ops("reference", device), **backends}
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}   dtype: {args.dtype}   peak: {args.peak_gbps:.0f} GB/s   shapes: {shapes}")
    header = f"{'op':28s} {'case':26s} {'reference ms':>13s} {'triton ms':>10s} {'speedup':>8s} {'GB/s':>8s} {'% peak':>7s}"
    print(header)
    print("-" * len(header))
    results = []
    with torch.inference_mode():
        for case in _cases(shapes, device, dtype):
            row, ms = _row(case, backends, device, args.peak_gbps, args.rounds)
            print(row, flush=True)
            results.append({"op": case.op, "case": case.shape, "bytes": case.nbytes, "ms": ms})
    if device.type != "cuda":
        print("(interpreter timings are a smoke test only; bandwidth figures are meaningless here)")
    print(describe_box(bench.before))
    bench.write(args.json, {"device": name, "shapes": str(shapes), "cases": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
