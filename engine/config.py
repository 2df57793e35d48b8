"""EngineConfig: typed msgspec structs in sections, validated on load *and* on construction.

``EngineConfig.load(path, overrides={"scheduler.policy": "lpm"})`` reads TOML, JSON or
YAML (by extension), applies dotted overrides, and converts strictly: an unknown key, a
wrong type or an out-of-range value raises ``ConfigError`` naming the key and the value.
Building the structs in code (``CacheConfig(block_size=0)``) runs the same checks, so no
invalid config can reach the engine. Every tool accepts ``--config FILE`` and
``--set section.key=value`` (see ``deltaserve.engine.cli``).

Every field carries its documentation (``msgspec.Meta(description=...)``);
``docs/config.md`` is generated from it (``python tools/gen_config_docs.py``) and a test
fails when the two disagree.

Byte sizes (every ``*_bytes`` key) take an int or a string with a unit (``"4GiB"``,
``"512MB"``; ``deltaserve.engine.byte_size``), in a file, in ``--set`` and in code.

The pieces live by noun: ``config_base`` (enums, the validating ``_Section`` base),
``config_sections`` (every section but ``[model]``), ``config_load`` (files, ``--set``,
error messages); every name is importable from here. This module never imports torch (the
cache simulator loads it).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec

from deltaserve.engine.byte_size import format_bytes, parse_bytes
from deltaserve.engine.config_base import (
    CoreProcess,
    DType,
    GiB,
    KernelBackend,
    LogLevel,
    MiB,
    PosInt,
    StateDType,
    _bad,
    _doc,
    _Section,
)
from deltaserve.engine.config_kv_events import KVEventsConfig
from deltaserve.engine.config_load import (
    _explain,
    normalise_data,
    parse_override,
    read_config_file,
    set_dotted,
)
from deltaserve.engine.config_sections import (
    CacheConfig,
    EngineLoopConfig,
    KernelsConfig,
    LoggingConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from deltaserve.engine.config_spec import SpecMethod, SpeculativeConfig
from deltaserve.engine.errors import ConfigError

# names importable from here (the sections, the enums, the loading helpers) for every caller
__all__ = [
    "CacheConfig", "ConfigError", "CoreProcess", "DType", "EngineConfig", "EngineLoopConfig", "GiB",
    "KVEventsConfig", "KernelBackend", "KernelsConfig", "LogLevel", "LoggingConfig", "MiB", "ModelConfig",
    "SchedulerConfig", "SpecMethod", "SpeculativeConfig", "StateDType", "StructuredOutputsConfig", "format_bytes",
    "parse_bytes", "parse_override",
    "read_config_file", "set_dotted",
]  # fmt: skip


class ModelConfig(_Section):
    """``[model]``: which model runs, where, in which dtype."""

    section_key: ClassVar[str] = "model"

    path: Annotated[
        str,
        _doc(
            "The model: `builtin:tiny-qwen3.5` (default), `builtin:tiny-qwen3-next`, `builtin:tiny-qwen3`, "
            "or a local Hugging Face-format folder (config.json + safetensors + tokenizer files).",
            min_length=1,
        ),
    ] = "builtin:tiny-qwen3.5"
    tokenizer: Annotated[
        str | None,
        _doc(
            "The tokenizer (and chat template), when not the model's own: a local Hugging Face-format "
            "folder or `builtin:<name>`. Unset: the model folder's."
        ),
    ] = None
    dtype: Annotated[
        DType,
        _doc(
            "Weights and KV-cache dtype: float32, bfloat16, float16, or auto (bfloat16 on CUDA, float32 on CPU)."
        ),
    ] = DType.AUTO
    ssm_state_dtype: Annotated[
        StateDType,
        _doc(
            "The recurrent GDN state's dtype, live and in every checkpoint: float32, bfloat16, or auto "
            "(the model config's `mamba_ssm_dtype` when it names one of these, else float32). "
            "bfloat16 halves a checkpoint's state bytes, so every cache tier holds more of them; "
            "outputs then differ from a float32 state's, with or without cache hits alike."
        ),
    ] = StateDType.AUTO
    device: Annotated[
        str,
        _doc(
            "auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N. A CUDA device "
            "that is not there is a ConfigError at engine start; `engine.ready` logs the choice."
        ),
    ] = "auto"
    max_model_len: Annotated[
        PosInt | None,
        _doc(
            "Longest sequence (prompt + output) a request may reach. Default: the smaller of the model's "
            "maximum and what the KV pool can hold for one request; an explicit value the pool cannot "
            "hold is a ConfigError naming both numbers."
        ),
    ] = None
    seed: Annotated[
        int, _doc("Seed of the random generator used by requests without their own seed.", ge=0, le=2**63 - 1)
    ] = 0
    generation_config: Annotated[
        str,
        _doc(
            "Where requests' sampling defaults come from (vLLM's --generation-config): `auto`, the "
            "model folder's generation_config.json (its temperature, top_p, top_k, min_p and "
            "repetition_penalty fill the fields a request leaves unset); `vllm`, none (the built-in "
            "neutral defaults); or a folder holding a generation_config.json. `engine.sampling_defaults` "
            "logs the values in use at start.",
            min_length=1,
        ),
    ] = "auto"
    chat_template: Annotated[
        str | None,
        _doc(
            "A Jinja chat template file whose contents replace the tokenizer's template (vLLM's "
            "--chat-template). Unset: the tokenizer's own. A request's own `chat_template` still wins."
        ),
    ] = None

    def check(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise _bad("model.device", self.device, "expected auto, cpu, cuda or cuda:N")


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole engine configuration: ``[model]``, ``[cache]``, ``[scheduler]``, ``[kernels]``,
    ``[engine]``, ``[structured_outputs]``, ``[logging]``, ``[kv_events]`` (every key: docs/config.md).

    Build it with ``EngineConfig.load(path, overrides)`` (TOML/JSON/YAML), ``from_dict``, or
    in code (``EngineConfig(cache=CacheConfig(block_size=32))``); all three validate and
    raise ``ConfigError`` naming the key and the value. ``replace(**{"a.b": v})`` returns a
    validated copy.
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    kernels: KernelsConfig = msgspec.field(default_factory=KernelsConfig)
    engine: EngineLoopConfig = msgspec.field(default_factory=EngineLoopConfig)
    structured_outputs: StructuredOutputsConfig = msgspec.field(default_factory=StructuredOutputsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    kv_events: KVEventsConfig = msgspec.field(default_factory=KVEventsConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        for name, cls in _sections().items():
            if not isinstance(getattr(self, name), cls):
                value = getattr(self, name)
                raise ConfigError(
                    f"{name} = {value!r}: expected a {cls.__name__}, got a {type(value).__name__}"
                )
        self.validate()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> EngineConfig:
        """Read ``path`` (TOML, JSON or YAML; None: defaults) and apply dotted ``overrides``."""
        data: dict[str, Any] = read_config_file(path) if path is not None else {}
        for key, value in (overrides or {}).items():
            set_dotted(data, key, value)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Convert nested plain data (as read from a file) strictly; ``ConfigError`` if invalid."""
        normalise_data(data, _sections())
        try:
            return msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ConfigError(_explain(str(e), data, _sections())) from None

    def to_dict(self) -> dict[str, Any]:
        """Nested plain data (enums as their values), the inverse of ``from_dict``."""
        return msgspec.to_builtins(self)

    def replace(self, **dotted: Any) -> EngineConfig:
        """A copy with dotted keys replaced: ``cfg.replace(**{"scheduler.policy": "lpm"})``."""
        data = self.to_dict()
        for key, value in dotted.items():
            set_dotted(data, key, value)
        return EngineConfig.from_dict(data)

    def validate(self) -> None:
        """Rules across sections; raise ``ConfigError``."""
        # (the checkpoint unit lcm(block_size, 64) may exceed the token budget: checked by
        # the engine, which knows whether the model has GDN layers at all; speculation works
        # with async scheduling: its verify steps are not overlapped, engine/core/overlap.py)


@functools.cache
def _sections() -> dict[str, type]:
    """Every section's name and struct, in ``EngineConfig``'s order."""
    return {f.name: f.type for f in msgspec.structs.fields(EngineConfig)}
