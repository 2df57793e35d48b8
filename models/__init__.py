"""Models written for the engine's flattened varlen batch, their weight loader and the
built-in tiny checkpoints. See docs/contracts.md for the batch and cache layouts."""

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
