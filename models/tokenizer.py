"""The tokenizer a model path names, loaded without the model: the front end of every placement
(in this process, beside a core process, at a cluster ingress) tokenizes and detokenizes with it.

``load_tokenizer(path)`` takes ``model.tokenizer`` or ``model.path`` as configured: a folder
holding tokenizer files, or ``builtin:NAME`` (built on first use). It loads exactly what
``load_model`` loads beside the weights; a folder without tokenizer files, or one that does
not load, is a ``TokenizerLoadError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaserve.models.loader import _load_tokenizer, _tokenizer_folder


def load_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer of ``path`` (module docstring)."""
    return _load_tokenizer(_tokenizer_folder(path))
