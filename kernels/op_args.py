"""The kernel ops' public signatures, written once for both backends, and their argument objects.

Every op of docs/contracts.md ("Kernel ops") has one positional/keyword signature on every
backend. A backend implements an op as a function of one frozen argument object
(``GdnChunkArgs``, ``ConvStepArgs``, ...); the ``*_op`` factories below wrap that function into
the public op, so each signature, its defaults and the packing of a prefill batch's metadata
(``VarlenBatch``) exist once. The public op carries the implementation's docstring and module
(``help()`` and ``Ops`` tables name the backend) and its own signature (``inspect.signature``
shows the contract, not the argument object).

The argument objects also hold the checks both backends make the same way, with the same
messages: the head grouping (``GdnArgs.group``, ``AttentionArgs.group``), the reference's
``cu_seqlens`` check (``VarlenBatch.bounds``) and the capture lists (``capture_triples``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeVar

import torch
from torch import Tensor

__all__ = [
    "GDN_CHUNK_SIZE",
    "NormKind",
    "AttentionArgs",
    "Capture",
    "ConvArgs",
    "ConvStepArgs",
    "ConvVarlenArgs",
    "GdnArgs",
    "GdnChunkArgs",
    "GdnStepArgs",
    "StoreKVArgs",
    "VarlenBatch",
    "capture_triples",
    "check_capture_seq",
    "conv_step_op",
    "conv_varlen_op",
    "gdn_chunk_op",
    "gdn_step_op",
    "paged_attention_op",
    "slot_copy_op",
    "store_kv_op",
]

#: Tokens per chunk of the chunked GDN kernels. Checkpoint boundaries are multiples of it (the
#: cache manager's torch-free ``GDN_CHUNK_SIZE`` is the same number; a test holds them equal).
GDN_CHUNK_SIZE = 64

Capture = tuple[int, int, int]  # (segment, tokens of it before the capture, destination slot)
Result = TypeVar("Result")


class NormKind(IntEnum):
    """The RMSNorm variants of ``models/norms.py`` (the fused ``rms_norm`` op's ``kind``)."""

    PLAIN = 0  # weight * normed, the product in the input dtype
    ZERO_CENTERED = 1  # normed * (1 + weight) in float32
    GATED = 2  # weight * normed, times silu(gate) in float32


def _public(op: Callable[..., Result], impl: Callable[..., Result]) -> Callable[..., Result]:
    """``op`` presented as ``impl``'s: its docstring and module; the signature stays ``op``'s."""
    op.__doc__ = impl.__doc__
    op.__module__ = impl.__module__
    op.__qualname__ = op.__name__
    return op


def _group(num_heads: int, num_kv_heads: int, many: str, few: str) -> int:
    """Heads per key/value head; ``many`` and ``few`` are how the message names the two counts."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{many}={num_heads} is not a multiple of {few}={num_kv_heads}")
    return num_heads // num_kv_heads


def capture_triples(
    seqs: Sequence[int] | None, positions: Sequence[int] | None, slots: Sequence[int] | None
) -> list[Capture]:
    """The captures as (segment, position, slot), empty when none is asked for; the three lists
    come together and are equally long."""
    if seqs is None and positions is None and slots is None:
        return []
    if seqs is None or positions is None or slots is None:
        raise ValueError("capture_seq, capture_pos and capture_slots must be given together")
    if not len(seqs) == len(positions) == len(slots):
        raise ValueError("capture_seq, capture_pos and capture_slots must have the same length")
    return list(zip(seqs, positions, slots))


def check_capture_seq(seq: int, num_seqs: int) -> None:
    """A capture's segment is one of this call's (``capture_seq`` counts from its ``cu_seqlens``)."""
    if not 0 <= seq < num_seqs:
        raise ValueError(f"capture_seq {seq} outside this call's batch of {num_seqs} segments")


@dataclass(frozen=True)
class VarlenBatch:
    """A prefill batch as the varlen state ops see it: segment ``b`` is tokens
    ``[cu_seqlens[b], cu_seqlens[b + 1])``; its state lives in slot ``state_slots[b]``, read first
    iff ``has_initial_state[b]``; capture ``c`` writes the state after ``capture_pos[c]`` tokens of
    segment ``capture_seq[c]`` to slot ``capture_slots[c]`` (no captures: all three None)."""

    cu_seqlens: Tensor
    state_slots: Tensor
    has_initial_state: Tensor
    capture_seq: Tensor | None = None
    capture_pos: Tensor | None = None
    capture_slots: Tensor | None = None

    def bounds(self, num_tokens: int) -> list[int]:
        """``cu_seqlens`` on the host, checked to run from 0 to ``num_tokens``."""
        bounds = [int(b) for b in self.cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != num_tokens:
            raise ValueError(f"cu_seqlens must run from 0 to T={num_tokens}, got {bounds[0]}..{bounds[-1]}")
        return bounds

    def captures(self) -> list[Capture]:
        """``capture_triples`` of the capture tensors (one host copy each)."""
        given = (self.capture_seq, self.capture_pos, self.capture_slots)
        return capture_triples(*(None if c is None else c.tolist() for c in given))


@dataclass(frozen=True)
class GdnArgs:
    """The operands of both GDN ops: ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g, beta [T, Hv]``
    and the state tensor ``ssm_state [slots, Hv, Dk, Dv]``."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    ssm_state: Tensor
    use_qk_l2norm: bool

    def group(self) -> int:
        """Value heads per key head (value head ``h`` reads key head ``h // group``)."""
        return _group(self.v.shape[-2], self.q.shape[-2], "Hv", "Hk")


@dataclass(frozen=True)
class GdnChunkArgs(GdnArgs):
    batch: VarlenBatch
    chunk_size: int

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError("chunk_size must be positive")


@dataclass(frozen=True)
class GdnStepArgs(GdnArgs):
    state_slots: Tensor  # [N]: one token, one live slot per sequence


@dataclass(frozen=True)
class ConvArgs:
    """The operands of both conv ops: ``x [T, C]``, ``weight [C, K]``, ``bias [C]`` or None,
    ``conv_state [slots, C, K - 1]`` and the activation (``"silu"``/``"swish"`` or None)."""

    x: Tensor
    weight: Tensor
    bias: Tensor | None
    conv_state: Tensor
    activation: str | None


@dataclass(frozen=True)
class ConvVarlenArgs(ConvArgs):
    batch: VarlenBatch


@dataclass(frozen=True)
class ConvStepArgs(ConvArgs):
    state_slots: Tensor


@dataclass(frozen=True)
class StoreKVArgs:
    key: Tensor  # [T, Hkv, Dk]
    value: Tensor  # [T, Hkv, Dv]
    k_cache: Tensor  # [num_blocks, block_size, Hkv, Dk]
    v_cache: Tensor
    slot_mapping: Tensor  # [T], -1: do not store


@dataclass(frozen=True)
class AttentionArgs:
    q: Tensor  # [T, Hq, D]
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor  # [B, max blocks]
    cu_seqlens_q: Tensor  # [B + 1]
    seq_lens: Tensor  # [B]
    scale: float

    def group(self) -> int:
        """Query heads per KV head (query head ``h`` reads KV head ``h // group``)."""
        return _group(self.q.shape[1], self.v_cache.shape[2], "Hq", "Hkv")


def gdn_chunk_op(impl: Callable[[GdnChunkArgs], Tensor]) -> Callable[..., Tensor]:
    """``chunk_gated_delta_rule`` (chunked varlen GDN prefill) over a backend's ``impl``."""

    def chunk_gated_delta_rule(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        cu_seqlens: Tensor,
        ssm_state: Tensor,
        state_slots: Tensor,
        has_initial_state: Tensor,
        capture_seq: Tensor | None = None,
        capture_pos: Tensor | None = None,
        capture_slots: Tensor | None = None,
        chunk_size: int = GDN_CHUNK_SIZE,
        use_qk_l2norm: bool = True,
    ) -> Tensor:
        batch = VarlenBatch(
            cu_seqlens, state_slots, has_initial_state, capture_seq, capture_pos, capture_slots
        )
        return impl(GdnChunkArgs(q, k, v, g, beta, ssm_state, bool(use_qk_l2norm), batch, chunk_size))

    return _public(chunk_gated_delta_rule, impl)


def gdn_step_op(impl: Callable[[GdnStepArgs], Tensor]) -> Callable[..., Tensor]:
    """``recurrent_gated_delta_rule`` (one GDN decode token per sequence) over ``impl``."""

    def recurrent_gated_delta_rule(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        ssm_state: Tensor,
        state_slots: Tensor,
        use_qk_l2norm: bool = True,
    ) -> Tensor:
        return impl(GdnStepArgs(q, k, v, g, beta, ssm_state, bool(use_qk_l2norm), state_slots))

    return _public(recurrent_gated_delta_rule, impl)


def conv_varlen_op(impl: Callable[[ConvVarlenArgs], Tensor]) -> Callable[..., Tensor]:
    """``causal_conv1d_varlen`` (the short conv of a prefill batch) over ``impl``."""

    def causal_conv1d_varlen(
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        cu_seqlens: Tensor,
        conv_state: Tensor,
        state_slots: Tensor,
        has_initial_state: Tensor,
        capture_seq: Tensor | None = None,
        capture_pos: Tensor | None = None,
        capture_slots: Tensor | None = None,
        activation: str | None = "silu",
    ) -> Tensor:
        batch = VarlenBatch(
            cu_seqlens, state_slots, has_initial_state, capture_seq, capture_pos, capture_slots
        )
        return impl(ConvVarlenArgs(x, weight, bias, conv_state, activation, batch))

    return _public(causal_conv1d_varlen, impl)


def conv_step_op(impl: Callable[[ConvStepArgs], Tensor]) -> Callable[..., Tensor]:
    """``causal_conv1d_update`` (one conv input per sequence, state shifted in place) over ``impl``."""

    def causal_conv1d_update(
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        conv_state: Tensor,
        state_slots: Tensor,
        activation: str | None = "silu",
    ) -> Tensor:
        return impl(ConvStepArgs(x, weight, bias, conv_state, activation, state_slots))

    return _public(causal_conv1d_update, impl)


def store_kv_op(impl: Callable[[StoreKVArgs], None]) -> Callable[..., None]:
    """``store_kv`` (this step's keys and values into the paged caches) over ``impl``."""

    def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        impl(StoreKVArgs(key, value, k_cache, v_cache, slot_mapping))

    return _public(store_kv, impl)


def paged_attention_op(impl: Callable[[AttentionArgs], Tensor]) -> Callable[..., Tensor]:
    """``paged_attention`` (causal attention over the paged context) over ``impl``."""

    def paged_attention(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        cu_seqlens_q: Tensor,
        seq_lens: Tensor,
        scale: float,
    ) -> Tensor:
        return impl(AttentionArgs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale))

    return _public(paged_attention, impl)


def slot_copy_op(impl: Callable[[Sequence[Tensor], Tensor, Tensor], None]) -> Callable[..., None]:
    """``copy_state_slots`` over ``impl(tensors, src, dst)``, which gets the checked host copies
    of the slot lists (equally long, distinct destinations) and is not called for empty ones."""

    def copy_state_slots(
        tensors: Sequence[Tensor], src_slots: Tensor | Sequence[int], dst_slots: Tensor | Sequence[int]
    ) -> None:
        pairs = _slot_pairs(src_slots, dst_slots)
        if pairs is not None:
            impl(tensors, *pairs)

    return _public(copy_state_slots, impl)


def _slot_pairs(
    src_slots: Tensor | Sequence[int], dst_slots: Tensor | Sequence[int]
) -> tuple[Tensor, Tensor] | None:
    """Validated host copies of the slot lists (None when there is nothing to copy).

    Slot lists are bookkeeping-sized; one host copy lets every backend validate them once for
    all tensors: equal lengths, no duplicate destination.
    """
    src_cpu = torch.as_tensor(src_slots, dtype=torch.long).cpu().reshape(-1)
    dst_cpu = torch.as_tensor(dst_slots, dtype=torch.long).cpu().reshape(-1)
    if src_cpu.numel() != dst_cpu.numel():
        raise ValueError(f"{src_cpu.numel()} source slots but {dst_cpu.numel()} destination slots")
    if src_cpu.numel() == 0:
        return None
    if torch.unique(dst_cpu).numel() != dst_cpu.numel():
        raise ValueError(f"duplicate destination slots in {dst_cpu.tolist()}")
    return src_cpu, dst_cpu
