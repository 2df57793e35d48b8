"""Models written for the engine's flattened varlen batch, their weight loader and the
built-in tiny checkpoints. See docs/contracts.md for the batch and cache layouts.

Every name loads on first use, so torch-free tools (the cache simulator, the workload
builders) can import ``deltaserve.models.builtin_tokenizer`` without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.models.batch import BatchMetadata, CacheSpec, ModelCaches
    from deltaserve.models.builtin import ensure_builtin_model
    from deltaserve.models.loader import (
        SUPPORTED_MODEL_TYPES,
        LoadedModel,
        ModelLoadError,
        ModelNotFoundError,
        TokenizerLoadError,
        UnsupportedModelError,
        WeightMismatchError,
        load_model,
    )

_LAZY = {
    **dict.fromkeys(("BatchMetadata", "CacheSpec", "ModelCaches"), "deltaserve.models.batch"),
    "ensure_builtin_model": "deltaserve.models.builtin",
    **dict.fromkeys(
        (
            "SUPPORTED_MODEL_TYPES",
            "LoadedModel",
            "ModelLoadError",
            "ModelNotFoundError",
            "TokenizerLoadError",
            "UnsupportedModelError",
            "WeightMismatchError",
            "load_model",
        ),
        "deltaserve.models.loader",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deltaserve.models' has no attribute {name!r}")


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "BatchMetadata",
    "CacheSpec",
    "LoadedModel",
    "ModelCaches",
    "ModelLoadError",
    "ModelNotFoundError",
    "TokenizerLoadError",
    "UnsupportedModelError",
    "WeightMismatchError",
    "ensure_builtin_model",
    "load_model",
]
