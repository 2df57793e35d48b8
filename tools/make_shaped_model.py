#!/usr/bin/env python
"""Write a random-weight Hugging Face folder with the *shape* of a real model.

    python tools/make_shaped_model.py qwen3.5-0.8b /tmp/qwen35-08b            # bf16 weights
    python tools/make_shaped_model.py qwen3.5-0.8b /tmp/q --dtype float32

Nothing can be downloaded here, but capacity planning, memory sizing and speed depend only
on a model's shape: this writes ``config.json`` with the real architecture numbers, random
weights (the built-in models' deterministic init) as safetensors, and the built-in byte-level
tokenizer (the vocabulary is the real size; token ids past the tokenizer's are never produced
by it, which does not matter for sizing or throughput) with a Qwen3.5-style chat template
(``tools/qwen35_template.py``: XML tool calls, ``<think>`` opened by the generation prompt),
so ``deltaserve serve FOLDER`` parses tool calls and reasoning as it would for the real model.
Like the real checkpoints it carries a multi-token-prediction head in real shapes
(``mtp_num_hidden_layers`` in ``config.json``, ``mtp.*`` tensors in ``model-mtp.safetensors``,
from their own seed). ``write_shaped_model(..., shape=)`` also takes a Qwen3-Next-style shape
(``model_type`` ``qwen3_next`` with its MoE keys; the head's experts are written per expert,
as published). Loadable by ``model.path = FOLDER``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# Architecture numbers of public checkpoints (config.json "text_config"); weights are random.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "full_attention_interval": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_num_value_heads": 16,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
    },
}


# model_type -> (transformers config class, model class) of the folders this writes
_CLASSES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}


def save_tokenizer(out: Path) -> Any:
    """The built-in tokenizer with the Qwen3.5-style chat template, saved into ``out``."""
    from deltaserve.models.builtin import build_tokenizer
    from deltaserve.tools.qwen35_template import QWEN35_CHAT_TEMPLATE

    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN35_CHAT_TEMPLATE  # type: ignore[attr-defined]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    return tokenizer


def write_shaped_model(
    name: str, out: Path, dtype: str = "bfloat16", shape: dict[str, Any] | None = None
) -> Path:
    """Write the folder for ``SHAPES[name]`` (or the given ``shape``, same keys) into ``out``;
    ``model_type`` ``qwen3_5_text`` or ``qwen3_next`` (then with its MoE keys)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    from deltaserve.models.builtin import (
        MTP_SEED,
        MTP_WEIGHTS_FILE,
        WEIGHT_SEED,
        _special_ids,
        add_weights_file,
        init_random_weights,
        mtp_checkpoint_tensors,
    )

    shape = dict(SHAPES[name] if shape is None else shape)
    model_type = shape.pop("model_type")
    config_cls, model_cls = _CLASSES[model_type]
    interval = shape.pop("full_attention_interval")
    n = shape["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    tokenizer = save_tokenizer(out)
    config = getattr(transformers, config_cls)(**shape, layer_types=layer_types, **_special_ids(tokenizer))

    torch.manual_seed(WEIGHT_SEED)
    with torch.device("cpu"):
        model = getattr(transformers, model_cls)(config).to(getattr(torch, dtype))
    init_random_weights(model, WEIGHT_SEED)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id], pad_token_id=config.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    del model  # the head below is drawn separately, from its own seed
    add_weights_file(
        out, MTP_WEIGHTS_FILE, mtp_checkpoint_tensors(config, seed=MTP_SEED, dtype=getattr(torch, dtype))
    )
    (out / "SHAPED.json").write_text(
        json.dumps({"shape": name, "seed": WEIGHT_SEED, "dtype": dtype}, indent=2) + "\n"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    print(write_shaped_model(args.shape, args.out, args.dtype))


if __name__ == "__main__":
    main()
