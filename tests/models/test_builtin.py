"""The built-in tiny checkpoints: built once, deterministic, loadable, with a usable tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers

from deltaserve.models import ensure_builtin_model, load_model
from deltaserve.models.builtin import builtin_names
from tests.models.driver import PagedRunner, Work
from tests.tolerances import assert_logits_close, greedy_determined, greedy_gap_ratio

HF_CLASSES = {
    "tiny-qwen3.5": transformers.Qwen3_5ForCausalLM,
    "tiny-qwen3-next": transformers.Qwen3NextForCausalLM,
    "tiny-qwen3": transformers.Qwen3ForCausalLM,
}
SAMPLE_PROMPTS = (
    "Hello, how are you?",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village by the sea",
    "def add(a, b):\n    return a + b\n" * 3,
)


def digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_names() -> None:
    assert builtin_names() == ["tiny-qwen3", "tiny-qwen3-next", "tiny-qwen3.5"]


def test_built_once_and_reused(builtin_paths: dict[str, Path], cache_root: Path) -> None:
    path = builtin_paths["tiny-qwen3.5"]
    assert path == cache_root / "models" / "tiny-qwen3.5-v2"
    before = {f.name: f.stat().st_mtime_ns for f in path.iterdir()}
    hashes = digest(path)
    assert ensure_builtin_model("tiny-qwen3.5", cache_dir=cache_root / "models") == path
    assert {f.name: f.stat().st_mtime_ns for f in path.iterdir()} == before
    assert digest(path) == hashes
    # the atomic build leaves no temporary folders behind
    assert sorted(p.name for p in (cache_root / "models").iterdir()) == sorted(
        f"{n}-v2" for n in builtin_names()
    )
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= set(hashes)


def test_deterministic_bytes(builtin_paths: dict[str, Path], tmp_path: Path) -> None:
    again = ensure_builtin_model("tiny-qwen3.5", cache_dir=tmp_path)
    assert digest(again) == digest(builtin_paths["tiny-qwen3.5"])


def test_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="unknown builtin model 'nope'; available: tiny-qwen3, tiny-qwen3-next, tiny-qwen3.5"
    ):
        ensure_builtin_model("nope", cache_dir=tmp_path)


def test_tiny_qwen35_shape(builtin_paths: dict[str, Path]) -> None:
    cfg = json.loads((builtin_paths["tiny-qwen3.5"] / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (256, 8, 512)
    assert cfg["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 64)
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert (cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]) == (2, 64)
    assert (cfg["linear_num_value_heads"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]) == (
        4,
        64,
        4,
    )
    assert (cfg["max_position_embeddings"], cfg["vocab_size"]) == (8192, 1024)
    moe = json.loads((builtin_paths["tiny-qwen3-next"] / "config.json").read_text())
    assert (moe["model_type"], moe["num_experts"], moe["num_experts_per_tok"]) == ("qwen3_next", 4, 2)


def test_load_by_builtin_name(
    builtin_paths: dict[str, Path], cache_root: Path, monkeypatch: pytest.MonkeyPatch, envs
) -> None:  # noqa: ANN001
    monkeypatch.setenv("DELTASERVE_CACHE", str(cache_root))
    loaded = load_model("builtin:tiny-qwen3.5", dtype=torch.float32, device="cpu", ops=envs.ops)
    assert loaded.path == builtin_paths["tiny-qwen3.5"]
    assert loaded.model_type == "qwen3_5_text"
    assert loaded.max_position_embeddings == 8192
    tok = loaded.tokenizer
    assert loaded.eos_token_ids == [
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    ]
    assert loaded.model.cache_spec().num_gdn_layers == 6


def test_tokenizer(builtin_paths: dict[str, Path]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(builtin_paths["tiny-qwen3.5"])
    assert tok.is_fast and len(tok) == 1024
    for text in (
        "Hello, world!",
        "  spaces\tand\nnewlines\n\n",
        "naïve café — 中文 🙂",
        "x = [1, 2, 3]  # 42",
    ):
        assert tok.decode(tok.encode(text)) == text
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = tok.encode(special)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == special
    assert tok.eos_token == "<|im_end|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        rendered
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages[1:], tokenize=False) == "<|im_start|>user\nHi!<|im_end|>\n"


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3-next", "tiny-qwen3"])
def test_builtin_parity_margin_and_greedy(name: str, builtin_paths: dict[str, Path], envs) -> None:  # noqa: ANN001
    """Logits match transformers; greedy generation (prefill, then decode steps through paged
    caches) is token-identical; and every row that decides a generated token has a top-1/top-2
    gap above twice the logits tolerance, so token identity follows from the tolerance on any
    CPU instead of hanging on a near-tie (tests/tolerances.py)."""
    path = builtin_paths[name]
    loaded = load_model(path, dtype=torch.float32, device="cpu", ops=envs.ops)
    hf = HF_CLASSES[name].from_pretrained(path, dtype=torch.float32).eval()
    tok = loaded.tokenizer
    prompts = [
        *SAMPLE_PROMPTS,
        tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
    ]
    runner = PagedRunner(loaded.model, ops=envs.ops)
    ids = [tok.encode(p) for p in prompts]
    outs = runner.step([Work(runner.add(i), len(i)) for i in ids])
    near_ties = worst = 0
    for i, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([i]), use_cache=False).logits[0]
        worst = max(worst, assert_logits_close(out, ref, f"{name} prompt of {len(i)} tokens"))
        near_ties += int((~greedy_determined(ref)).sum())

    prompt = ids[-1]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[
            0, len(prompt) :
        ].tolist()
        generated_ids = torch.tensor([prompt + expected[:-1]])
        deciding = hf(input_ids=generated_ids, use_cache=False).logits[0, len(prompt) - 1 :]
    assert expected and deciding.argmax(-1).tolist() == expected
    gaps = greedy_gap_ratio(deciding)
    assert greedy_determined(deciding).all(), (
        f"{name}: greedy steps {(gaps <= 2).nonzero().flatten().tolist()} are near-ties "
        f"(top-1/top-2 gap {gaps.min().item():.2f}x the tolerance <= 2x): token parity would be a coin toss"
    )
    print(
        f"[builtin] {name}: {worst:.1%} of the logits tolerance; greedy steps' min top-1/top-2 gap "
        f"{gaps.min().item():.0f}x the tolerance; {near_ties} near-tie prompt rows of {sum(map(len, ids))}; "
        f"logit std {outs[0].std().item():.2f}"
    )
    runner = PagedRunner(loaded.model, ops=envs.ops)
    seq = runner.add(prompt + [0] * 8)
    (out,) = runner.step([Work(seq, len(prompt))])
    generated = []
    for step in range(8):
        token = int(out[-1].argmax())
        generated.append(token)
        seq.tokens[len(prompt) + step] = token
        if step < 7:
            (out,) = runner.step([Work(seq, 1)])
    assert generated[: len(expected)] == expected
