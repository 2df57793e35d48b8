"""deltaserve public API: ``AsyncEngine``, ``EngineConfig``, ``SamplingParams``, ``RequestOutput``."""

from engine.async_engine import AsyncEngine, install_uvloop
from engine.config import EngineConfig
from engine.core import EngineCore
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
