"""deltaserve public API: ``AsyncEngine``, ``EngineConfig``, ``SamplingParams``, ``RequestOutput``.

Torch-heavy names (``AsyncEngine``, ``EngineCore``) load on first use, so torch-free tools
(the cache simulator) can import ``engine.config``, ``engine.cli`` and friends cheaply.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.errors import (
    ConfigError,
    DeltaServeError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
)
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine, install_uvloop
    from engine.core import EngineCore

_LAZY = {"AsyncEngine": "engine.async_engine", "install_uvloop": "engine.async_engine", "EngineCore": "engine.core"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "AsyncEngine",
    "ConfigError",
    "DeltaServeError",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "install_uvloop",
]
