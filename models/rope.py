"""Rotary position embedding, rotate-half style, optionally on only the first dims of a head.

Contract:

* ``RotaryEmbedding.from_config(cfg)`` reads ``rope_parameters`` (``rope_theta``,
  ``rope_type``, ``partial_rotary_factor``) the way transformers 5 does; rotary dim is
  ``int(head_dim * partial_rotary_factor)``.
* ``cos_sin(positions, dtype)`` -> ``(cos, sin)`` each ``[T, rotary_dim]``, computed in fp32
  then cast to ``dtype`` (the HF order of operations, so bf16 rounding matches).
* ``apply_rotary(x [T, H, D], cos, sin)`` rotates ``x[..., :rotary_dim]`` and passes the rest.

Qwen3.5's multimodal rope (mrope) interleaves T/H/W frequency sections; for text the three
position ids are identical, so every section sees the same angle and it reduces to this
plain rope (checked against transformers in tests/models/test_rope.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# Rope types whose frequencies do not depend on the current sequence length: they can be
# precomputed once. "dynamic" and "longrope" rescale with the running length and would
# need per-sequence frequencies, which the flattened batch does not carry.
_STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


def rope_parameters(config: Any) -> dict[str, Any]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, inv_freq: Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        if rotary_dim % 2 or inv_freq.numel() * 2 != rotary_dim:
            raise ValueError(f"rotary_dim {rotary_dim} does not match {inv_freq.numel()} frequencies")
        self.rotary_dim = rotary_dim
        self.attention_scaling = attention_scaling
        # Explicit CPU device: models are built under torch.device("meta") by the loader and
        # this buffer is not in the checkpoint; it must hold real values, moved later by .to().
        self.register_buffer("inv_freq", inv_freq.to(device="cpu", dtype=torch.float32), persistent=False)

    @classmethod
    def from_config(cls, config: Any, head_dim: int) -> RotaryEmbedding:
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        rotary_dim = int(head_dim * params["partial_rotary_factor"])
        if rope_type == "default":
            base = float(params["rope_theta"])
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
            return cls(rotary_dim, 1.0 / (base**exponents), 1.0)
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (supported: {', '.join(_STATIC_ROPE_TYPES)})"
            )
        # The scaled variants are easy to get subtly wrong; reuse transformers' own formulas.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return cls(rotary_dim, inv_freq, float(scaling))

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [T, H, D]``, ``cos/sin [T, R]`` with ``R <= D``: rotate the first ``R`` dims."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)
