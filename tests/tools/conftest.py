"""Fixtures for the tools' tests: tokenizers of the built-in tiny model (and a synthetic one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.tools.workloads import Codec, SyntheticCodec, TokenizersCodec, builtin_model_dir


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    folder = builtin_model_dir("tiny-qwen3.5")
    if not (folder / "tokenizer.json").is_file():
        from deltaserve.models import ensure_builtin_model  # builds it (imports torch)

        folder = Path(ensure_builtin_model("tiny-qwen3.5"))
    return folder


@pytest.fixture(scope="session")
def tiny_codec(tiny_dir: Path) -> Codec:
    return TokenizersCodec(tiny_dir)


@pytest.fixture(scope="session", params=["tiny", "synthetic"])
def codec(request: pytest.FixtureRequest, tiny_dir: Path) -> Codec:
    return TokenizersCodec(tiny_dir) if request.param == "tiny" else SyntheticCodec()
