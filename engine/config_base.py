"""The pieces every config section is made of: the enums, the ``_Section`` base that validates
on construction, and the constrained number types.

``_Section.__post_init__`` runs when a section is built in code *and* when ``msgspec`` decodes
it (``EngineConfig.from_dict``): byte-size fields given as strings (``"4GiB"``) become ints
(``deltaserve.engine.byte_size``), then every field is checked against its declared type and
constraints, then the section's own ``check``. Every error is a one-line ``ConfigError``
naming the dotted key, the value and the limit. Torch-free.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, ClassVar

import msgspec

from deltaserve.engine.byte_size import NonNegBytes, PosBytes, parse_bytes, size_fields
from deltaserve.engine.errors import ConfigError

__all__ = [
    "CoreProcess", "DType", "Fraction", "GiB", "KernelBackend", "LogLevel", "MiB", "NonNegBytes",
    "NonNegInt", "PosBytes", "PosInt", "StateDType", "chosen_state_dtype",
]  # fmt: skip

MiB = 1024**2
GiB = 1024**3


def _doc(text: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **constraints)


class DType(str, enum.Enum):
    """Model weights and KV-cache dtype (the recurrent GDN state's is ``StateDType``)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    AUTO = "auto"  # bfloat16 on CUDA, float32 on the CPU


class StateDType(str, enum.Enum):
    """The recurrent GDN state's dtype: live slots and checkpoints on every tier alike."""

    AUTO = "auto"  # the model config's ``mamba_ssm_dtype`` when it names one of these, else float32
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


def chosen_state_dtype(choice: StateDType, named: object) -> tuple[StateDType, str]:
    """``model.ssm_state_dtype`` made concrete, and why: ``auto`` takes the model config's
    ``mamba_ssm_dtype`` (``named``, None when it has none) where that names a supported dtype,
    else float32. Torch-free: the engine and the simulator resolve it alike."""
    if choice is not StateDType.AUTO:
        return choice, "configured"
    name = str(named or "").removeprefix("torch.")
    if name in {d.value for d in StateDType} - {StateDType.AUTO.value}:
        return StateDType(name), "auto: the model config's mamba_ssm_dtype"
    return StateDType.FLOAT32, (
        f"auto: mamba_ssm_dtype = {name} is not supported" if name else "auto: no mamba_ssm_dtype"
    )


class KernelBackend(str, enum.Enum):
    """Which implementation of the kernel ops runs (``deltaserve.kernels.get_ops``)."""

    AUTO = "auto"  # Triton on CUDA, the PyTorch reference on the CPU
    REFERENCE = "reference"
    TRITON = "triton"


class CoreProcess(str, enum.Enum):
    """Where the engine core runs (``engine.core_process``; ``engine/front/core_client.py``)."""

    # `deltaserve serve`: separate; an application's AsyncEngine(config): in_process
    AUTO = "auto"
    IN_PROCESS = "in_process"  # the step thread shares the front end's process (and GIL)
    SEPARATE = "separate"  # the core in a process of its own (engine/core/core_proc.py)


class LogLevel(str, enum.Enum):
    """Level of the ``deltaserve`` logger (stdlib ``logging`` levels)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A config section: its fields are checked against their declared types and
    constraints when it is built in code too (msgspec checks them only when decoding).
    ``section_key`` is its name in ``EngineConfig`` (the ``[cache]`` of ``cache.memory_bytes``),
    so an error names the key without looking the section up."""

    section_key: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name in size_fields(type(self)):  # "4GiB" -> bytes, before the type check below
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, parse_bytes(value, f"{_section_name(type(self))}.{name}"))
        for f in msgspec.structs.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, msgspec.Struct):
                continue  # a nested section validated itself when it was built
            try:
                msgspec.convert(value, f.type, strict=True)
            except msgspec.ValidationError as e:
                reason = re.sub(r" - at `\$[^`]*`", "", str(e))
                key = f"{_section_name(type(self))}.{f.name}"
                raise ConfigError(f"{key} = {value!r}: {_enum_hint(reason, f.type)}") from None
        self.check()

    def check(self) -> None:
        """Cross-field rules of the section; raise ``ConfigError``."""


def _section_name(cls: type) -> str:
    return getattr(cls, "section_key", cls.__name__)


def _bad(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{key} = {value!r}: {why}")


PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)]


def _enum_hint(reason: str, typ: Any) -> str:
    """msgspec says 'Invalid enum value'; say which values are allowed."""
    if "Invalid enum value" in reason:
        base = getattr(typ, "__origin__", typ)
        args = getattr(typ, "__args__", ())
        for t in (base, *args, *getattr(base, "__args__", ())):  # (an optional enum: a union)
            if isinstance(t, type) and issubclass(t, enum.Enum):
                return "expected one of " + ", ".join(m.value for m in t)
    return reason
