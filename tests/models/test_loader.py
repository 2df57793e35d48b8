"""``load_model``: folder layouts it accepts, and the exact errors for the ones it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from deltaserve.models import (
    ModelLoadError,
    ModelNotFoundError,
    TokenizerLoadError,
    UnsupportedModelError,
    WeightMismatchError,
    load_model,
)
from tests.models.conftest import EnvFactory
from tests.models.driver import PagedRunner, Work
from tests.models.test_parity import random_tokens
from tests.tolerances import assert_logits_close


def copy_checkpoint(envs: EnvFactory, name: str, dst: Path) -> Path:
    shutil.copytree(envs.write_checkpoint(name), dst)
    return dst


def load(path: Path | str, envs: EnvFactory, dtype: torch.dtype = torch.float32):  # noqa: ANN201
    return load_model(path, dtype=dtype, device="cpu", ops=envs.ops)


def test_missing_folder(tmp_path: Path, envs: EnvFactory) -> None:
    path = tmp_path / "nowhere"
    with pytest.raises(ModelNotFoundError) as exc:
        load(path, envs)
    assert str(exc.value) == f"model folder not found: {path}"
    assert isinstance(exc.value, ModelLoadError)


def test_folder_without_config(tmp_path: Path, envs: EnvFactory) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        load(tmp_path, envs)
    assert str(exc.value) == f"no config.json in model folder {tmp_path}"


def test_unknown_model_type(tmp_path: Path, envs: EnvFactory) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedModelError) as exc:
        load(tmp_path, envs)
    assert str(exc.value) == (
        f"unsupported model_type 'llama' in {tmp_path / 'config.json'} "
        "(supported: qwen3, qwen3_5, qwen3_5_text, qwen3_next)"
    )


def test_unknown_builtin(envs: EnvFactory) -> None:
    with pytest.raises(ModelNotFoundError, match="unknown builtin model 'tiny-llama'; available: "):
        load("builtin:tiny-llama", envs)


def test_no_weight_files(tmp_path: Path, envs: EnvFactory) -> None:
    path = copy_checkpoint(envs, "qwen3-dense", tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError) as exc:
        load(path, envs)
    assert str(exc.value) == f"no *.safetensors weights in model folder {path}"


def _rewrite_weights(path: Path, edit) -> None:  # noqa: ANN001
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_weight(tmp_path: Path, envs: EnvFactory) -> None:
    path = copy_checkpoint(envs, "qwen3_5-gqa2-ratio2", tmp_path / "ckpt")
    _rewrite_weights(path, lambda t: t.pop("model.layers.0.linear_attn.A_log"))
    with pytest.raises(WeightMismatchError) as exc:
        load(path, envs)
    assert exc.value.missing == ["model.layers.0.linear_attn.A_log"]
    assert exc.value.unexpected == [] and exc.value.mismatched == []
    assert str(exc.value) == (
        f"checkpoint in {path} does not match the model: 1 missing: model.layers.0.linear_attn.A_log"
    )


def test_unexpected_and_misshaped_weights(tmp_path: Path, envs: EnvFactory) -> None:
    path = copy_checkpoint(envs, "qwen3-dense", tmp_path / "ckpt")

    def edit(t: dict) -> None:
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.zeros(3)

    _rewrite_weights(path, edit)
    with pytest.raises(WeightMismatchError) as exc:
        load(path, envs)
    assert exc.value.unexpected == ["model.layers.0.self_attn.extra.weight"]
    assert exc.value.mismatched == ["model.norm.weight: checkpoint (3,) vs model (64,)"]
    assert str(exc.value) == (
        f"checkpoint in {path} does not match the model: "
        "1 unexpected: model.layers.0.self_attn.extra.weight; "
        "1 mis-shaped: model.norm.weight: checkpoint (3,) vs model (64,)"
    )


def test_missing_tokenizer(tmp_path: Path, envs: EnvFactory) -> None:
    path = copy_checkpoint(envs, "qwen3-dense", tmp_path / "ckpt")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (path / name).unlink(missing_ok=True)
    with pytest.raises(TokenizerLoadError) as exc:
        load(path, envs)
    assert str(exc.value) == (
        f"cannot load a tokenizer from {path}: none of tokenizer.json, tokenizer.model, vocab.json found"
    )


def test_loaded_model_fields(envs: EnvFactory) -> None:
    vl = envs.get("qwen3_5-vl")
    loaded = vl.loaded
    assert loaded.model_type == "qwen3_5"
    assert loaded.hf_config.model_type == "qwen3_5_text"
    assert loaded.max_position_embeddings == 4096
    assert loaded.path == vl.path
    assert loaded.eos_token_ids == [loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert all(not p.requires_grad and p.device.type == "cpu" for p in loaded.model.parameters())
    tied = envs.get("qwen3_5-attnfirst-gqa4-ratio1-tied").loaded.model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_fused_expert_weights(tmp_path: Path, envs: EnvFactory) -> None:
    """Experts saved as 3-D ``experts.gate_up_proj``/``down_proj`` load like per-expert keys."""
    name = "qwen3_next-moe-gqa1"
    path = copy_checkpoint(envs, name, tmp_path / "fused")
    cfg = envs.get(name).hf.config

    def fuse(t: dict) -> None:
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}.mlp.experts"
            if f"{p}.0.gate_proj.weight" not in t:
                continue
            experts = range(cfg.num_experts)
            gate_up = [
                torch.cat([t.pop(f"{p}.{e}.gate_proj.weight"), t.pop(f"{p}.{e}.up_proj.weight")])
                for e in experts
            ]
            t[f"{p}.gate_up_proj"] = torch.stack(gate_up)
            t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in experts])

    _rewrite_weights(path, fuse)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(path / "model.safetensors"))
    fused = load(path, envs).model.state_dict()
    per_expert = envs.get(name).loaded.model.state_dict()
    assert fused.keys() == per_expert.keys()
    for k in fused:
        assert torch.equal(fused[k], per_expert[k]), k


def test_sharded_checkpoint(tmp_path: Path, envs: EnvFactory) -> None:
    env = envs.get("qwen3_5-gqa2-ratio2")
    path = tmp_path / "sharded"
    env.hf.save_pretrained(path, max_shard_size="100KB")
    for f in envs.tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    sharded = load(path, envs).model.state_dict()
    single = env.loaded.model.state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_bfloat16_is_as_accurate_as_transformers_bfloat16(envs: EnvFactory) -> None:
    """bf16 rounding differs with op order, so no tight bf16-vs-bf16 bound exists; instead our
    bf16 logits must be as close to the fp32 truth as transformers' own bf16 logits are."""
    env = envs.get("qwen3_5-gqa2-ratio2")
    loaded = load(env.path, envs, dtype=torch.bfloat16)
    assert loaded.model.cache_spec().dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    tokens = random_tokens(150, seed=9)
    truth = env.reference(tokens)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(env.path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf_bf16 = hf(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    runner = PagedRunner(loaded.model, ops=envs.ops)
    (ours,) = runner.step([Work(runner.add(tokens), len(tokens))])
    ours_err, hf_err = (ours - truth).abs(), (hf_bf16 - truth).abs()
    assert ours_err.mean() <= 1.25 * hf_err.mean()
    assert ours_err.max() <= 1.25 * hf_err.max()


def test_vl_checkpoint_skips_vision_and_mtp(envs: EnvFactory) -> None:
    env = envs.get("qwen3_5-vl")
    names = set(env.loaded.model.state_dict())
    assert not any("visual" in n or n.startswith("mtp.") or "language_model" in n for n in names)
    tokens = random_tokens(20, seed=1)
    runner = env.runner()
    (out,) = runner.step([Work(runner.add(tokens), 20)])
    assert_logits_close(out, env.reference(tokens), "qwen3_5 VL folder, text-only")
