"""deltaserve public API: ``AsyncEngine``, ``EngineConfig``, ``SamplingParams``, ``RequestOutput``.

The front-end seam (``engine/front/client.py``): ``EngineClient`` (what ``AsyncEngine``, the one
front end, implements over the core client its placement picks: ``engine/front/core_client.py``),
``RequestInput``, ``ModelInfo``; ``InputProcessor`` validates and tokenizes. Torch-heavy names
(``AsyncEngine``, ``EngineCore``) load on first use, so torch-free tools (the cache simulator) can import ``engine.config``, ``engine.cli``
and friends cheaply.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.constraint import Constraint, ConstraintKind
from deltaserve.engine.errors import (
    ConfigError,
    DeltaServeError,
    EngineDeadError,
    EngineOverloadedError,
    GrammarTimeoutError,
    InvalidRequestError,
    PromptTooLongError,
)
from deltaserve.engine.front.client import EngineClient, ModelInfo, RequestInput
from deltaserve.engine.outputs import RequestOutput
from deltaserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deltaserve.engine.core.engine_core import EngineCore
    from deltaserve.engine.front.async_engine import AsyncEngine, install_uvloop
    from deltaserve.engine.front.input_processor import InputProcessor

_LAZY = {
    "AsyncEngine": "deltaserve.engine.front.async_engine",
    "install_uvloop": "deltaserve.engine.front.async_engine",
    "EngineCore": "deltaserve.engine.core.engine_core",
    "InputProcessor": "deltaserve.engine.front.input_processor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deltaserve.engine' has no attribute {name!r}")


__all__ = [
    "AsyncEngine",
    "ConfigError",
    "Constraint",
    "ConstraintKind",
    "DeltaServeError",
    "EngineConfig",
    "EngineClient",
    "EngineCore",
    "EngineDeadError",
    "EngineOverloadedError",
    "GrammarTimeoutError",
    "InputProcessor",
    "InvalidRequestError",
    "ModelInfo",
    "PromptTooLongError",
    "RequestInput",
    "RequestOutput",
    "SamplingParams",
    "install_uvloop",
]
