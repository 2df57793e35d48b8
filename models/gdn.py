"""Gated DeltaNet token mixer (Qwen3.5 and Qwen3-Next "linear_attention" layers).

Contract (per token; ``Hk`` key heads of dim ``Dk``, ``Hv`` value heads of dim ``Dv``):

* projections -> ``mixed_qkv [T, 2*Hk*Dk + Hv*Dv]`` (q, k, v channels in that order: the
  conv-state layout of contracts.md), ``z [T, Hv, Dv]``, ``b, a [T, Hv]``.
  Qwen3.5 has separate ``in_proj_qkv/z/b/a``; Qwen3-Next fuses them into ``in_proj_qkvz`` and
  ``in_proj_ba`` laid out per key head (see ``FusedGatedDeltaNet``).
* depthwise causal conv1d (``conv1d.weight [C, 1, K]``, no bias) + silu over ``mixed_qkv``.
* ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32, log-decay <= 0).
* gated delta rule with q/k L2 norm (inside the op), output ``[T, Hv, Dv]``.
* ``out_proj(GatedRMSNorm(o, z))``.

Batch split: the first ``num_decodes`` tokens are one-token decodes (``causal_conv1d_update``
+ ``recurrent_gated_delta_rule``, in place on their live slots); then the verify segments'
tokens (speculative decoding: the same decode ops, one window position at a time, recording
the states after each position: ``models/verify.py``); the rest are prefill segments
(``causal_conv1d_varlen`` + ``chunk_gated_delta_rule``), to which the batch's ``cu_seqlens``,
slots and capture list are passed re-based to the prefill part (``GdnSegments``, computed
once per forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaserve.models.fusion import concat_linears
from deltaserve.models.linear import Linear
from deltaserve.models.norms import GatedRMSNorm
from deltaserve.models.verify import VerifyPlan, VerifyRecord

if TYPE_CHECKING:
    from deltaserve.kernels import Ops
    from deltaserve.models.batch import BatchMetadata


@dataclass(frozen=True)
class GdnSegments:
    """The batch as the GDN ops see it: decodes, then prefill segments re-based to start at 0."""

    num_decodes: int
    decode_slots: Tensor  # [num_decodes]
    prefill_cu_seqlens: Tensor | None  # [P+1], None when there is no prefill
    prefill_slots: Tensor
    prefill_has_initial_state: Tensor
    capture_seq: Tensor | None  # [C] index among prefill segments, None when C == 0
    capture_pos: Tensor | None
    capture_slots: Tensor | None
    # verify segments (models/verify.py): their plan, and per window position j the token rows
    # (counted from the first verify token) and live slots of the segments still running
    verify: VerifyPlan | None = None
    verify_rows: tuple[Tensor, ...] = ()
    verify_slots: tuple[Tensor, ...] = ()

    @classmethod
    def from_batch(cls, batch: BatchMetadata) -> GdnSegments:
        nd, nv, plan = batch.num_decodes, batch.num_verify, batch.verify
        first = nd + nv  # the first prefill segment
        # Decodes are one token each, so the verify tokens start at token nd and the prefill
        # part after them.
        offset = nd + (plan.num_tokens if plan is not None else 0)
        has_prefill = batch.num_seqs > first
        has_capture = batch.capture_seq.numel() > 0
        rows: tuple[Tensor, ...] = ()
        slots: tuple[Tensor, ...] = ()
        if plan is not None and nv:
            starts = batch.cu_seqlens[nd:first] - nd
            rows = tuple(starts[:m] + j for j, m in enumerate(plan.counts))
            slots = tuple(batch.state_slots[nd : nd + m] for m in plan.counts)
        return cls(
            num_decodes=nd,
            decode_slots=batch.state_slots[:nd],
            prefill_cu_seqlens=batch.cu_seqlens[first:] - offset if has_prefill else None,
            prefill_slots=batch.state_slots[first:],
            prefill_has_initial_state=batch.has_initial_state[first:],
            capture_seq=batch.capture_seq - first if has_capture else None,
            capture_pos=batch.capture_pos if has_capture else None,
            capture_slots=batch.capture_slots if has_capture else None,
            verify=plan if nv else None,
            verify_rows=rows,
            verify_slots=slots,
        )

    def run(
        self,
        decode: Callable[[], Tensor],
        prefill: Callable[[], Tensor],
        verify: Callable[[], Tensor] | None = None,
    ) -> Tensor:
        """The decodes' output (``decode()``, run when there are decodes) followed on the token
        axis by the verify segments' (``verify()``) and the prefill segments' (``prefill()``),
        each run when there are such."""
        out = []
        if self.num_decodes > 0:
            out.append(decode())
        if self.verify is not None and verify is not None:
            out.append(verify())
        if self.prefill_cu_seqlens is not None:
            out.append(prefill())
        return out[0] if len(out) == 1 else torch.cat(out, dim=0)

    def verify_tokens(self) -> slice:
        """The verify segments' rows on the token axis."""
        n = self.verify.num_tokens if self.verify is not None else 0
        return slice(self.num_decodes, self.num_decodes + n)

    def run_verify(
        self,
        step: Callable[[Tensor, Tensor], Tensor],
        inputs: Tensor,
        state: Tensor,
        record: list[Tensor],
    ) -> Tensor:
        """The verify tokens, window position by window position: ``step(rows, slots)`` is
        the decode op on those rows of the verify tokens and those live slots (in place);
        the state of each segment after every position but the last is appended to
        ``record``. ``inputs``: the verify tokens' (for the output's shape)."""
        assert self.verify is not None
        out: Tensor | None = None
        last = len(self.verify_rows) - 1
        for j, (rows, slots) in enumerate(zip(self.verify_rows, self.verify_slots, strict=True)):
            y = step(rows, slots)
            if out is None:
                out = inputs.new_empty((inputs.shape[0], *y.shape[1:]), dtype=y.dtype)
            out[rows] = y
            if j < last:
                record.append(state.index_select(0, slots))
        assert out is not None
        return out

    def prefill(
        self, op: Callable[..., Tensor], inputs: tuple[Tensor | None, ...], state: Tensor, **options: object
    ) -> Tensor:
        """The varlen state ``op`` on the prefill segments: its ``inputs`` (the prefill tokens'),
        then this batch's segments, ``state``, slots and captures, in the order every varlen op
        takes them (docs/contracts.md, "Kernel ops")."""
        return op(
            *inputs,
            self.prefill_cu_seqlens,
            state,
            self.prefill_slots,
            self.prefill_has_initial_state,
            capture_seq=self.capture_seq,
            capture_pos=self.capture_pos,
            capture_slots=self.capture_slots,
            **options,
        )


class GatedDeltaNet(nn.Module):
    """Qwen3.5 layout: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; sized by a
    transformers text ``config`` (``hidden_size``, ``linear_num_key_heads``,
    ``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``,
    ``linear_conv_kernel_dim``, ``rms_norm_eps``)."""

    def __init__(self, config: Any, *, ops: Ops) -> None:
        super().__init__()
        num_k_heads, num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {num_k_heads}")
        hidden_size, conv_kernel = config.hidden_size, config.linear_conv_kernel_dim
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = num_k_heads * self.head_k_dim
        self.value_dim = num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.ops = ops
        # nn.Conv1d only as the holder of ``conv1d.weight [C, 1, K]`` (the checkpoint name);
        # the convolution itself runs in the ops, against the state slots.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.in_proj: nn.Linear | None = None  # set by fuse_projections()
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)
        self._init_projections(hidden_size)

    def _init_projections(self, hidden_size: int) -> None:
        self.in_proj_qkv = Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden_size, self.num_v_heads, bias=False)

    def fuse_projections(self) -> None:
        self.in_proj = concat_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> ``mixed_qkv [T, conv_dim]``, ``z [T, Hv, Dv]``, ``b [T, Hv]``, ``a [T, Hv]``."""
        if self.in_proj is not None:
            sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
            qkv, z, b, a = self.in_proj(x).split(sizes, dim=-1)
            return qkv, z.reshape(x.shape[0], self.num_v_heads, self.head_v_dim), b, a
        z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: Tensor, seg: GdnSegments, conv_state: Tensor, ssm_state: Tensor) -> Tensor:
        t = x.shape[0]
        mixed_qkv, z, b, a = self.project(x)
        mixed_qkv = self._conv(mixed_qkv, seg, conv_state)
        q, k, v = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        # fp32: in fp16/bf16 exp(A_log) can overflow, and g is accumulated over many tokens.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = self._delta_rule(q, k, v, g, beta, seg, ssm_state)
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(t, self.value_dim))

    def _conv(self, mixed_qkv: Tensor, seg: GdnSegments, conv_state: Tensor) -> Tensor:
        """The short convolution: the decodes' one-token update, then the prefill segments."""
        nd, vt = seg.num_decodes, seg.verify_tokens()
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        return seg.run(
            lambda: self.ops.causal_conv1d_update(mixed_qkv[:nd], weight, None, conv_state, seg.decode_slots),
            lambda: seg.prefill(
                self.ops.causal_conv1d_varlen, (mixed_qkv[vt.stop :], weight, None), conv_state
            ),
            lambda: self._verify_conv(mixed_qkv[vt], weight, seg, conv_state),
        )

    def _verify_conv(self, x: Tensor, weight: Tensor, seg: GdnSegments, conv_state: Tensor) -> Tensor:
        """The verify tokens' conv, one window position at a time (``models/verify.py``); opens
        this layer's ``VerifyRecord``."""
        assert seg.verify is not None
        rec = VerifyRecord()
        seg.verify.records.append(rec)
        return seg.run_verify(
            lambda rows, slots: self.ops.causal_conv1d_update(x[rows], weight, None, conv_state, slots),
            x,
            conv_state,
            rec.conv,
        )

    def _delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seg: GdnSegments, ssm_state: Tensor
    ) -> Tensor:
        """The gated delta rule: the decodes' recurrent step, then the prefill segments' chunked
        scan (which writes the captured states into their slots)."""
        nd, vt = seg.num_decodes, seg.verify_tokens()
        p = vt.stop
        decodes, prefill = (
            (q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd]),
            (q[p:], k[p:], v[p:], g[p:], beta[p:]),
        )
        return seg.run(
            lambda: self.ops.recurrent_gated_delta_rule(
                *decodes, ssm_state, seg.decode_slots, use_qk_l2norm=True
            ),
            lambda: seg.prefill(self.ops.chunk_gated_delta_rule, prefill, ssm_state, use_qk_l2norm=True),
            lambda: self._verify_delta_rule(q[vt], k[vt], v[vt], g[vt], beta[vt], seg, ssm_state),
        )

    def _verify_delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seg: GdnSegments, ssm_state: Tensor
    ) -> Tensor:
        """The verify tokens' recurrent steps, one window position at a time, into this layer's
        ``VerifyRecord`` (opened by ``_verify_conv``)."""
        assert seg.verify is not None
        rec = seg.verify.records[-1]
        return seg.run_verify(
            lambda rows, slots: self.ops.recurrent_gated_delta_rule(
                q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_state, slots, use_qk_l2norm=True
            ),
            v,
            ssm_state,
            rec.ssm,
        )


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next layout: ``in_proj_qkvz`` / ``in_proj_ba``, grouped per key head.

    Output features of ``in_proj_qkvz`` are ``Hk`` groups of ``[q (Dk), k (Dk), v (r*Dv),
    z (r*Dv)]`` with ``r = Hv / Hk``; ``in_proj_ba`` is ``Hk`` groups of ``[b (r), a (r)]``
    (transformers' ``fix_query_key_value_ordering``). The conv weight is over the
    de-interleaved ``[all q, all k, all v]`` channels.
    """

    def _init_projections(self, hidden_size: int) -> None:
        self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden_size, 2 * self.num_v_heads, bias=False)

    def fuse_projections(self) -> None:
        self.in_proj = concat_linears(self.in_proj_qkvz, self.in_proj_ba)
        del self.in_proj_qkvz, self.in_proj_ba

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        t = x.shape[0]
        hk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // hk
        if self.in_proj is not None:
            qkvz_flat, ba_flat = self.in_proj(x).split(
                [2 * self.key_dim + 2 * self.value_dim, 2 * self.num_v_heads], -1
            )
        else:
            qkvz_flat, ba_flat = self.in_proj_qkvz(x), self.in_proj_ba(x)
        qkvz = qkvz_flat.reshape(t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = ba_flat.reshape(t, hk, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        mixed_qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        z = z.reshape(t, self.num_v_heads, dv)
        return mixed_qkv, z, b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads)
