"""Cache sizes and prefill cost of a hybrid model from its Hugging Face ``config.json``,
without torch (for the simulator's ``--config`` / ``model.path``).

For Qwen3.5 and Qwen3-Next (a ``text_config`` section is read when present):

* full-attention layers: ``layer_types`` entries ``full_attention`` (else every
  ``full_attention_interval``-th layer); the others are Gated DeltaNet layers;
* KV per token = attention layers x 2 (K, V) x ``num_key_value_heads`` x ``head_dim`` x 2
  bytes (bf16);
* one checkpoint (or live state) = GDN layers x (conv state ``conv_dim x (kernel - 1)`` in
  bf16, ``conv_dim = 2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads
  * linear_value_head_dim``, + recurrent state ``linear_num_value_heads x linear_key_head_dim
  x linear_value_head_dim`` in fp32, or bf16 where ``model.ssm_state_dtype`` — or, left at
  auto, the config's ``mamba_ssm_dtype`` — says so);
* prefill cost (``CacheManagerConfig.prefill_cost_per_token`` / ``_pair``, FLOPs): about
  2 x the weights a token passes through (projections, MLP or the active experts), and per
  (token, earlier token) pair 4 x heads x head_dim per attention layer (QK^T and PV).

Models without GDN layers get a zero checkpoint size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaserve.engine.config_base import StateDType, chosen_state_dtype
from deltaserve.tools.workloads import builtin_model_dir

KV_DTYPE_BYTES = 2  # bf16
CONV_DTYPE_BYTES = 2  # bf16
#: the recurrent state's bytes per value by ``model.ssm_state_dtype``
STATE_BYTES = {"float32": 4, "bfloat16": 2}  # fp32 unless the state is configured bfloat16


def state_dtype_bytes(ssm_state_dtype: str, cfg: dict[str, Any]) -> int:
    """Bytes per recurrent-state value under ``model.ssm_state_dtype`` (``auto``: as the engine
    resolves it from the config's ``mamba_ssm_dtype``)."""
    named = cfg.get("text_config", cfg).get("mamba_ssm_dtype")
    return STATE_BYTES[chosen_state_dtype(StateDType(ssm_state_dtype), named)[0].value]


@dataclass(frozen=True)
class ModelSizes:
    name: str
    attention_layers: int
    gdn_layers: int
    kv_bytes_per_token: int
    checkpoint_bytes: int
    prefill_flops_per_token: float
    prefill_flops_per_token_pair: float


def config_path(model_path: str) -> Path:
    """``config.json`` of ``builtin:NAME`` or a local folder."""
    folder = (
        builtin_model_dir(model_path.split(":", 1)[1])
        if model_path.startswith("builtin:")
        else Path(model_path)
    )
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_path}: no config.json at {path}")
    return path


def sizes_from_config(cfg: dict[str, Any], name: str = "", ssm_state_dtype: str = "auto") -> ModelSizes:
    state_bytes = state_dtype_bytes(ssm_state_dtype, cfg)
    cfg = cfg.get("text_config", cfg)
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        attention = sum(1 for t in types if t == "full_attention")
    elif "full_attention_interval" in cfg:
        attention = n_layers // int(cfg["full_attention_interval"])
    else:
        attention = n_layers  # a plain transformer
    gdn = n_layers - attention
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv = attention * 2 * kv_heads * head_dim * KV_DTYPE_BYTES
    ckpt = 0
    gdn_proj = 0
    if gdn:
        hk, hv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        kernel = int(cfg["linear_conv_kernel_dim"])
        conv_dim = 2 * hk * dk + hv * dv
        ckpt = gdn * (conv_dim * (kernel - 1) * CONV_DTYPE_BYTES + hv * dk * dv * state_bytes)
        gdn_proj = hidden * (conv_dim + 2 * hv + hv * dv) + hv * dv * hidden  # in (qkv, a, b, z), out
    attn_proj = hidden * (heads * head_dim * 2 + 2 * kv_heads * head_dim)  # q (+gate), k, v, o
    if "num_experts" in cfg and cfg.get("num_experts"):
        inter = int(cfg["moe_intermediate_size"]) * int(cfg["num_experts_per_tok"])
        inter += int(cfg.get("shared_expert_intermediate_size") or 0)
    else:
        inter = int(cfg["intermediate_size"])
    mlp = 3 * hidden * inter
    weights = attention * attn_proj + gdn * gdn_proj + n_layers * mlp + hidden * int(cfg["vocab_size"])
    return ModelSizes(
        name=name,
        attention_layers=attention,
        gdn_layers=gdn,
        kv_bytes_per_token=kv,
        checkpoint_bytes=ckpt,
        prefill_flops_per_token=2.0 * weights,
        prefill_flops_per_token_pair=4.0 * attention * heads * head_dim,
    )


def model_sizes(model_path: str, ssm_state_dtype: str = "auto") -> ModelSizes:
    path = config_path(model_path)
    return sizes_from_config(json.loads(path.read_text()), name=model_path, ssm_state_dtype=ssm_state_dtype)
