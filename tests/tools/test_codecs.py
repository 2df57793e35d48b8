"""The workload codecs: the simulator's default tokenizer is the built-in models' one on every
machine, built without torch where no built-in model was built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.models import ensure_builtin_model
from deltaserve.tools.workloads import TokenizersCodec, builtin_model_dir, load_codec

REPO = Path(__file__).resolve().parents[2]


def test_builtin_model_dir_is_where_the_engine_builds_the_model(tiny_dir: Path) -> None:
    assert builtin_model_dir() == Path(ensure_builtin_model()) == tiny_dir


def test_default_codec_without_a_built_model_is_the_models_tokenizer(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path))
    alone = load_codec()
    assert alone.name == "tokenizers:tokenizer-v2"
    assert (tmp_path / "models" / "tokenizer-v2" / "tokenizer.json").is_file()
    shipped = TokenizersCodec(tiny_dir)
    texts = ["Hello! How are you today?", "def add(a, b):\n    return a + b\n", "3.14159 and 1,000,000"]
    for text in texts:
        assert alone.encode(text) == shipped.encode(text)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi!"},
    ]
    assert alone.render_chat(messages) == shipped.render_chat(messages)
    assert load_codec("builtin:tiny-qwen3-next").encode(texts[0]) == shipped.encode(texts[0])


def test_default_codec_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from deltaserve.tools.workloads import load_codec\n"
        "codec = load_codec()\n"
        "assert codec.name == 'tokenizers:tokenizer-v2', codec.name\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = {**os.environ, "DELTASERVE_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)


def test_unknown_builtin_tokenizer_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown builtin model 'tiny-nope'; available: tiny-qwen3, "):
        load_codec("builtin:tiny-nope")
