"""Built-in tiny checkpoints: deterministic random-weight models as ordinary HF folders.

Contract:

* ``ensure_builtin_model(name, cache_dir=None) -> Path`` returns
  ``<models dir>/<name>-v2``, building it once: the folder is written in a temporary
  sibling and renamed into place (atomic; a concurrent builder that loses the race drops
  its copy), and reused when present. ``<models dir>`` is ``cache_dir`` if given, else
  ``$DELTASERVE_CACHE/models``, else ``~/.cache/deltaserve/models``.
* The folder is what ``transformers`` ``save_pretrained`` writes (``config.json``,
  ``model.safetensors``, ``generation_config.json``) plus a fast byte-level BPE tokenizer
  (``tokenizer.json``, ``tokenizer_config.json``, Qwen-style chat template, eos
  ``<|im_end|>`` and ``<|endoftext|>``). The same name always yields the same bytes
  (fixed seeds, fixed corpus, deterministic BPE training).
* The hybrids also carry a multi-token-prediction head as real Qwen3.5 / Qwen3-Next folders
  do (``mtp_num_hidden_layers`` 1 in ``config.json``, ``mtp.*`` tensors in
  ``model-mtp.safetensors``, drawn from ``MTP_SEED`` by ``mtp_checkpoint_tensors``): v2 is v1
  plus that file, every v1 tensor byte-identical (``model.safetensors`` is written as before).
* ``init_random_weights(model, seed)`` is the weight init (also used by the tests): larger
  than the usual 0.02 so logits spread by several units (greedy parity is then not decided
  by near-ties), norm weights perturbed so zero-centred vs plain norms differ, and GDN
  decays spanning ~1 to ~1000 tokens of memory.

Names: ``tiny-qwen3.5`` (default), ``tiny-qwen3-next`` (4 experts, top-2), ``tiny-qwen3``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn

from deltaserve.models.builtin_tokenizer import (
    BUILTIN_NAMES,
    BUILTIN_VERSION,
    DEFAULT_BUILTIN,
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    build_once,
    build_tokenizer,
    builtin_model_dir,
    check_builtin_name,
)

WEIGHT_SEED = 1234
# The MTP head's own generator: its tensors are drawn after, and independently of, the target's.
MTP_SEED = 4321
MTP_WEIGHTS_FILE = "model-mtp.safetensors"
# The final norm's output has unit RMS, so lm_head rows of std GAIN/sqrt(hidden) give logits of
# std ~GAIN: wide enough that top-1/top-2 gaps dwarf fp32 noise (greedy parity is not a coin toss).
LM_HEAD_GAIN = 5.0


@torch.no_grad()
def init_random_weights(
    model: nn.Module, seed: int = WEIGHT_SEED, lm_head_gain: float = LM_HEAD_GAIN
) -> None:
    """Overwrite every parameter from a private generator (see module docstring for why)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def uniform(shape: torch.Size, low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (high - low) + low

    # Sorted names: the draw order, hence the weights, do not depend on module construction order.
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("A_log"):
            value = uniform(p.shape, 0.1, 2.0).log()
        elif name.endswith("dt_bias"):
            value = uniform(p.shape, -5.0, -2.0)
        elif "norm" in name.rsplit(".", 2)[-2]:
            # Zero-centred norms start at 0 and plain/gated ones at 1 (HF init): perturb around it.
            value = p.detach().float().cpu() + normal(p.shape, 0.1)
        elif "conv1d" in name:
            value = normal(p.shape, 1.0 / math.sqrt(p.shape[-1]))
        elif "embed_tokens" in name:
            value = normal(p.shape, 1.0)
        elif name.startswith("lm_head"):
            value = normal(p.shape, lm_head_gain / math.sqrt(p.shape[-1]))
        elif p.dim() >= 2:
            value = normal(p.shape, 1.0 / math.sqrt(p.shape[-1]))
        else:
            value = normal(p.shape, 0.02)
        p.copy_(value.to(p.dtype))


def _tiny_qwen35_config(tokenizer: object) -> object:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_common_hybrid_kwargs(tokenizer))


def _tiny_qwen3_next_config(tokenizer: object) -> object:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_common_hybrid_kwargs(tokenizer),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _tiny_qwen3_config(tokenizer: object) -> object:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )


def _common_hybrid_kwargs(tokenizer: object) -> dict:
    linear, full = "linear_attention", "full_attention"
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        layer_types=[linear, linear, linear, full] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_num_value_heads=4,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )


def _special_ids(tokenizer: object) -> dict:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {"eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT], "bos_token_id": None}


def _model_class(model_type: str) -> type:
    import transformers

    return {
        "qwen3_5_text": transformers.Qwen3_5ForCausalLM,
        "qwen3_next": transformers.Qwen3NextForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[model_type]


_BUILDERS: Mapping[str, Callable[[object], object]] = MappingProxyType(
    {
        "tiny-qwen3.5": _tiny_qwen35_config,
        "tiny-qwen3-next": _tiny_qwen3_next_config,
        "tiny-qwen3": _tiny_qwen3_config,
    }
)


assert set(_BUILDERS) == set(BUILTIN_NAMES), "builtin_tokenizer.BUILTIN_NAMES lists every builder"


def builtin_names() -> list[str]:
    return sorted(_BUILDERS)


def write_builtin_model(name: str, out_dir: Path) -> None:
    """Write the checkpoint folder for ``name`` into the (existing, empty) ``out_dir``."""
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    config = _BUILDERS[name](tokenizer)
    torch.manual_seed(WEIGHT_SEED)  # HF's own init runs first; every parameter is then overwritten
    model = _model_class(config.model_type)(config)
    init_random_weights(model, WEIGHT_SEED)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, config.pad_token_id],
        pad_token_id=config.pad_token_id,
    )
    has_mtp = config.model_type != "qwen3"  # the hybrids ship an MTP head; Qwen3 dense has none
    if has_mtp:
        model.config.mtp_num_hidden_layers = 1
    model.save_pretrained(out_dir, safe_serialization=True)
    if has_mtp:
        add_weights_file(out_dir, MTP_WEIGHTS_FILE, mtp_checkpoint_tensors(model.config, seed=MTP_SEED))
    tokenizer.save_pretrained(out_dir)
    # Record the recipe: humans looking at the cache should know what this folder is.
    (out_dir / "BUILTIN.json").write_text(
        json.dumps({"name": name, "version": BUILTIN_VERSION, "seed": WEIGHT_SEED}, indent=2) + "\n"
    )


def mtp_checkpoint_tensors(
    config: object, *, seed: int = MTP_SEED, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random ``mtp.*`` tensors for a Qwen3.5 / Qwen3-Next text ``config`` (its
    ``mtp_num_hidden_layers``), in the names and shapes the published checkpoints use (MoE
    experts per expert), drawn by ``init_random_weights`` from ``seed``."""
    from deltaserve.kernels import get_ops
    from deltaserve.models.loader import SUPPORTED_MODEL_TYPES
    from deltaserve.models.moe import split_fused_expert_weights
    from deltaserve.models.norms import ZeroCenteredRMSNorm

    model_cls = SUPPORTED_MODEL_TYPES[config.model_type].model_cls  # type: ignore[attr-defined]
    layers = int(config.mtp_num_hidden_layers)  # type: ignore[attr-defined]
    # The target is built on the meta device (no memory for a real-size vocabulary); only the
    # head is materialised.
    with torch.device("meta"):
        model = model_cls(config, ops=get_ops("reference"), mtp_layers=layers)  # type: ignore[call-arg]
    head = model.mtp
    assert head is not None
    head.to_empty(device="cpu")
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, ZeroCenteredRMSNorm):  # init_random_weights perturbs the init value
                module.weight.fill_(module.weight_init)
    init_random_weights(head, seed)
    state = {f"mtp.{k}": v.to(dtype).contiguous() for k, v in head.state_dict().items()}
    return split_fused_expert_weights(state)


def add_weights_file(folder: Path, filename: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` as ``folder/filename`` beside the existing weights (listed in the shard
    index when the folder has one), leaving every existing file's bytes as they are."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(folder / filename), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update({name: filename for name in tensors})
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def ensure_builtin_model(name: str = DEFAULT_BUILTIN, cache_dir: str | os.PathLike | None = None) -> Path:
    check_builtin_name(name)
    return build_once(builtin_model_dir(name, cache_dir), lambda folder: write_builtin_model(name, folder))
