"""EngineConfig: typed msgspec structs in sections, validated on load.

``EngineConfig.load(path, overrides={"scheduler.policy": "lpm"})`` reads TOML, JSON or
YAML (by extension), applies dotted overrides, and converts strictly: an unknown key, a
wrong type or an out-of-range value raises ``ConfigError`` naming the key and the value.
Every tool accepts ``--config FILE`` and ``--set section.key=value`` (see ``engine.cli``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import msgspec
import tomllib

from deltaserve.cache.admission import ADMISSION_POLICIES
from deltaserve.engine.errors import ConfigError
from deltaserve.scheduler.policy import resolve_policy_class

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    path: str = "builtin:tiny-qwen3.5"
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (bf16 on CUDA, fp32 on CPU)
    device: str = "cpu"  # cpu | cuda | cuda:N
    max_model_len: PosInt | None = None  # default: the model's max_position_embeddings
    seed: NonNegInt = 0  # RNG for requests without their own seed


class CacheConfig(_Section):
    block_size: PosInt = 16
    num_kv_blocks: PosInt | None = None  # wins over kv_cache_bytes when set
    kv_cache_bytes: PosInt = 256 * 1024**2
    enable_prefix_caching: bool = True
    checkpoint_pool_bytes: NonNegInt = 64 * 1024**2
    checkpoint_staging_bytes: NonNegInt | None = None  # per step; None = unbounded
    checkpoint_interval: NonNegInt = 2048  # tokens (rounded up to the checkpoint unit); 0 = off
    checkpoint_policy: str = "default"
    namespace: str = ""  # salt separating caches that must not share (e.g. adapters)


class SchedulerConfig(_Section):
    policy: str = "fcfs"  # a registered name or "package.module:ClassName"
    policy_options: dict[str, Any] = {}
    max_num_seqs: PosInt = 64
    max_num_batched_tokens: PosInt = 2048
    max_num_partial_prefills: PosInt = 4
    enable_chunked_prefill: bool = True  # false: each prompt is prefilled whole in one step
    long_prefill_token_threshold: NonNegInt = 0  # >0: at most this many prompt tokens per request per step
    max_waiting: PosInt = 4096


class KernelsConfig(_Section):
    backend: str = "auto"  # auto | reference | triton


class LoggingConfig(_Section):
    stats_interval_s: float = 5.0
    level: str = "info"


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    kernels: KernelsConfig = msgspec.field(default_factory=KernelsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> EngineConfig:
        data: dict[str, Any] = read_config_file(path) if path is not None else {}
        for key, value in (overrides or {}).items():
            set_dotted(data, key, value)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        try:
            config = msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ConfigError(_explain(str(e), data)) from None
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def replace(self, **dotted: Any) -> EngineConfig:
        """A copy with dotted keys replaced: ``cfg.replace(**{"scheduler.policy": "lpm"})``."""
        data = self.to_dict()
        for key, value in dotted.items():
            set_dotted(data, key, value)
        return EngineConfig.from_dict(data)

    def validate(self) -> None:
        def bad(key: str, value: Any, why: str) -> ConfigError:
            return ConfigError(f"{key} = {value!r}: {why}")

        if self.model.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise bad("model.dtype", self.model.dtype, "expected one of float32, bfloat16, float16, auto")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.model.device):
            raise bad("model.device", self.model.device, "expected cpu, cuda or cuda:N")
        if self.kernels.backend not in ("auto", "reference", "triton"):
            raise bad("kernels.backend", self.kernels.backend, "expected one of auto, reference, triton")
        if self.scheduler.max_num_batched_tokens < 64:
            raise bad(
                "scheduler.max_num_batched_tokens",
                self.scheduler.max_num_batched_tokens,
                "must be >= 64 (one GDN chunk)",
            )
        if self.logging.stats_interval_s <= 0:
            raise bad("logging.stats_interval_s", self.logging.stats_interval_s, "must be > 0")
        if self.cache.checkpoint_policy not in ADMISSION_POLICIES:
            known = ", ".join(sorted(ADMISSION_POLICIES))
            raise bad("cache.checkpoint_policy", self.cache.checkpoint_policy, f"unknown; known: {known}")
        try:
            resolve_policy_class(self.scheduler.policy)
        except (ValueError, ImportError, AttributeError, TypeError) as e:
            raise bad("scheduler.policy", self.scheduler.policy, str(e)) from None


# ---------------------------------------------------------------------- helpers
def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = p.read_text()
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"{p}: unknown config format {suffix!r} (use .toml, .json, .yaml)")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: {e}") from None
    except Exception as e:  # yaml errors
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{p}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a table/object")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override key {key!r} must be section.key")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``section.key=value``; the value is read as a TOML literal, else a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if raw.lower() in ("none", "null"):
        value = None
    return key, value


def _explain(message: str, data: dict[str, Any]) -> str:
    """Turn msgspec's message into one naming the dotted key and the offending value."""
    m = re.search(r" - at `\$\.?([^`]*)`", message)
    where = m.group(1) if m else ""
    reason = message[: m.start()] if m else message
    unknown = re.search(r"unknown field `([^`]+)`", reason)
    if unknown:
        key = ".".join(p for p in (where, unknown.group(1)) if p)
        return f"{key}: unknown key"
    node: Any = data
    for part in where.split(".") if where else []:
        node = node.get(part) if isinstance(node, dict) else None
    return f"{where} = {node!r}: {reason}"
