"""``model.device = "auto"`` / ``model.dtype = "auto"`` (the defaults): resolution, the
``engine.device`` log line, and the config pinned to what runs (the prefix-cache salt names
the resolved dtype, never ``auto``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltaserve.engine import EngineCore
from deltaserve.engine.config import DType, ModelConfig
from deltaserve.engine.core import builder
from deltaserve.engine.core.builder import choose_device, resolve_dtype
from deltaserve.models import LoadedModel
from tests.engine.conftest import make_config


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **kw: None


def test_defaults_are_auto() -> None:
    m = ModelConfig()
    assert m.device == "auto" and m.dtype is DType.AUTO


@pytest.mark.parametrize(
    ("cuda", "device", "reason", "dtype"),
    [
        (False, "cpu", "auto: no CUDA", torch.float32),
        (True, "cuda", "auto: CUDA available", torch.bfloat16),
    ],
)
def test_auto_resolution(cuda: bool, device: str, reason: str, dtype: torch.dtype) -> None:
    chosen, why = choose_device("auto", cuda_available=cuda)
    assert (chosen, why) == (torch.device(device), reason)
    assert resolve_dtype(DType.AUTO, chosen) == dtype
    # an explicit choice is kept whatever the machine has
    assert choose_device("cpu", cuda_available=True) == (torch.device("cpu"), "configured")
    assert resolve_dtype("float16", chosen) == torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA resolution")
def test_engine_auto_on_cpu_pins_config(tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    monkeypatch.setattr(builder, "log", recorder)
    config = make_config(**{"model.device": "auto", "model.dtype": "auto"})
    assert config.model.device == "auto" and config.model.dtype is DType.AUTO
    core = EngineCore(config, loaded=tiny_loaded)
    assert core.device == torch.device("cpu") and core.dtype == torch.float32
    assert config.model.device == "cpu" and config.model.dtype is DType.FLOAT32
    # the salt (and so every prefix-cache key) names the resolved dtype
    assert core.input_processor.salt_parts[1] == "float32"
    events = [kw for name, kw in recorder.events if name == "engine.device"]
    assert events == [
        {"device": "cpu", "device_reason": "auto: no CUDA", "dtype": "float32", "dtype_reason": "auto: CPU"}
    ]
