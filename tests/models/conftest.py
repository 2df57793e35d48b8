"""Session fixtures: tiny checkpoints written by transformers' ``save_pretrained`` into a tmp
dir, loaded both by transformers (the oracle) and by ``models.load_model`` from the SAME folder.

Every config is small enough that the whole directory runs in well under two minutes on two
CPU cores in fp32, yet covers: GQA 1/2/4, GDN value/key head ratio 1 and 2 (and Dk != Dv),
layer patterns starting with either kind, tied embeddings, attention biases, MoE with dense
``mlp_only_layers``, and a vision-language ``qwen3_5`` folder (text weights under
``model.language_model.``, plus ``model.visual.*`` and ``mtp.*`` tensors to skip).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from deltaserve.kernels import Ops, get_ops
from deltaserve.models import LoadedModel, ensure_builtin_model, load_model
from deltaserve.models.builtin import build_tokenizer, builtin_names, init_random_weights
from tests.models.driver import PagedRunner

VOCAB = 1024  # the built-in tokenizer's size, so the tokenizer copied into each folder fits
LIN, FULL = "linear_attention", "full_attention"

_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=4096)


def _qwen35_gqa2_ratio2() -> Any:
    return transformers.Qwen3_5TextConfig(
        **_TINY,
        num_hidden_layers=4,
        layer_types=[LIN, LIN, LIN, FULL],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )


def _qwen35_attn_first_gqa4_ratio1_tied() -> Any:
    return transformers.Qwen3_5TextConfig(
        **_TINY,
        num_hidden_layers=4,
        layer_types=[FULL, LIN, FULL, LIN],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=True,
    )


def _qwen35_vl() -> Any:
    text = _qwen35_gqa2_ratio2().to_dict()
    text["rope_parameters"].update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return transformers.Qwen3_5Config(text_config=text, vision_config=vision)


def _qwen3_next_moe() -> Any:
    return transformers.Qwen3NextConfig(
        **_TINY,
        num_hidden_layers=4,
        layer_types=[LIN, FULL, LIN, FULL],
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )


def _qwen3_dense() -> Any:
    return transformers.Qwen3Config(
        **_TINY,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


# name -> (transformers class, config builder)
CONFIGS: dict[str, tuple[str, Callable[[], Any]]] = {
    "qwen3_5-gqa2-ratio2": ("Qwen3_5ForCausalLM", _qwen35_gqa2_ratio2),
    "qwen3_5-attnfirst-gqa4-ratio1-tied": ("Qwen3_5ForCausalLM", _qwen35_attn_first_gqa4_ratio1_tied),
    "qwen3_5-vl": ("Qwen3_5ForConditionalGeneration", _qwen35_vl),
    "qwen3_next-moe-gqa1": ("Qwen3NextForCausalLM", _qwen3_next_moe),
    "qwen3-dense": ("Qwen3ForCausalLM", _qwen3_dense),
}
HYBRID_CONFIGS = [n for n in CONFIGS if not n.startswith("qwen3-")]
ALL_CONFIGS = list(CONFIGS)


@dataclass
class Env:
    """One tiny checkpoint folder, loaded by transformers and by us."""

    name: str
    path: Path
    hf: Any
    loaded: LoadedModel
    ops: Ops

    @torch.no_grad()
    def reference(self, tokens: list[int]) -> torch.Tensor:
        """transformers' logits ``[len(tokens), vocab]`` for one unpadded sequence."""
        return self.hf(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()

    def runner(self, **kwargs: Any) -> PagedRunner:
        return PagedRunner(self.loaded.model, ops=self.ops, **kwargs)


class EnvFactory:
    def __init__(self, root: Path, tokenizer_dir: Path) -> None:
        self.root = root
        self.tokenizer_dir = tokenizer_dir
        self.ops = get_ops("reference")
        self._envs: dict[str, Env] = {}

    def write_checkpoint(self, name: str) -> Path:
        cls_name, make_config = CONFIGS[name]
        path = self.root / name
        if path.exists():
            return path
        torch.manual_seed(0)
        model = getattr(transformers, cls_name)(make_config())
        # Logit std ~3: fp32 noise (~5e-6 of a row's largest logit) stays well inside tests/tolerances.py.
        init_random_weights(model, seed=sum(map(ord, name)), lm_head_gain=3.0)
        model.save_pretrained(path, safe_serialization=True)
        for f in self.tokenizer_dir.iterdir():
            shutil.copy(f, path / f.name)
        if cls_name == "Qwen3_5ForConditionalGeneration":
            # Real Qwen3.5 folders also ship multi-token-prediction heads; the loader skips them.
            save_file({"mtp.fc.weight": torch.zeros(4, 4)}, str(path / "model-mtp.safetensors"))
        return path

    def get(self, name: str) -> Env:
        if name not in self._envs:
            path = self.write_checkpoint(name)
            hf = getattr(transformers, CONFIGS[name][0]).from_pretrained(path, dtype=torch.float32).eval()
            loaded = load_model(path, dtype=torch.float32, device="cpu", ops=self.ops)
            self._envs[name] = Env(name, path, hf, loaded, self.ops)
        return self._envs[name]


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private $DELTASERVE_CACHE (the user's ~/.cache is never touched by tests)."""
    return tmp_path_factory.mktemp("deltaserve-cache")


@pytest.fixture(scope="session")
def builtin_paths(cache_root: Path) -> dict[str, Path]:
    """Every built-in checkpoint, built once per session into ``cache_root``."""
    return {name: ensure_builtin_model(name, cache_dir=cache_root / "models") for name in builtin_names()}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def envs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> EnvFactory:
    return EnvFactory(tmp_path_factory.mktemp("checkpoints"), tokenizer_dir)


@pytest.fixture(params=ALL_CONFIGS)
def env(request: pytest.FixtureRequest, envs: EnvFactory) -> Env:
    return envs.get(request.param)


@pytest.fixture(params=HYBRID_CONFIGS)
def hybrid_env(request: pytest.FixtureRequest, envs: EnvFactory) -> Env:
    return envs.get(request.param)
