"""Reading config data: files (TOML, JSON, YAML), ``--set section.key=value`` overrides, and
msgspec's validation errors turned into one line naming the key and the value.

Byte sizes given as strings (``"4GiB"`` in a file or ``--set cache.memory_bytes=4GiB``) are
converted by ``normalise_data`` before msgspec sees them, with the same parser the sections'
constructors use (``deltaserve.engine.byte_size.parse_bytes``). Torch-free.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import tomllib

from deltaserve.engine.byte_size import parse_bytes, size_fields
from deltaserve.engine.config_base import _enum_hint
from deltaserve.engine.errors import ConfigError


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The top-level table of a TOML, JSON or YAML file; ``ConfigError`` if unreadable."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".json", ".yaml", ".yml"):
        raise ConfigError(f"{p}: unknown config format {suffix!r} (use .toml, .json, .yaml)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ConfigError(f"{p}: {e}") from None
    except Exception as e:  # yaml's own error types
        raise ConfigError(f"{p}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a table/object")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data["a"]["b"] = value`` for ``key = "a.b"``, creating sections as needed."""
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


def normalise_data(data: dict[str, Any], sections: dict[str, type]) -> None:
    """Byte sizes given as strings in ``data`` (``{"cache": {"memory_bytes": "4GiB"}}``) become
    ints in place, so msgspec's strict conversion sees the type it checks; ``ConfigError``
    naming the key when one is not a size."""
    for name, cls in sections.items():
        table = data.get(name)
        if not isinstance(table, dict):
            continue  # msgspec reports a section of the wrong type
        for key in size_fields(cls):
            if isinstance(table.get(key), str):
                table[key] = parse_bytes(table[key], f"{name}.{key}")


def _field_type(sections: dict[str, type], section: str, key: str) -> Any:
    cls = sections.get(section)
    if cls is None:
        return None
    for f in msgspec.structs.fields(cls):
        if f.name == key:
            return f.type
    return None


def _explain(message: str, data: dict[str, Any], sections: dict[str, type]) -> str:
    """Turn msgspec's message into one naming the dotted key and the offending value."""
    if re.match(r"^\S+\.\S+ = ", message):  # already ours (raised by a section's __post_init__)
        return re.sub(r" - at `\$[^`]*`$", "", message)
    m = re.search(r" - at `\$\.?([^`]*)`", message)
    where = m.group(1) if m else ""
    reason = message[: m.start()] if m else message
    unknown = re.search(r"unknown field `([^`]+)`", reason)
    if unknown:
        key = ".".join(p for p in (where, unknown.group(1)) if p)
        return f"{key}: unknown key"
    if reason.startswith(tuple(f"{s}." for s in sections)):
        return reason  # a ConfigError message from a section's check, wrapped by msgspec
    node: Any = data
    for part in where.split(".") if where else []:
        node = node.get(part) if isinstance(node, dict) else None
    parts = where.split(".")
    if len(parts) == 2:
        reason = _enum_hint(reason, _field_type(sections, *parts))
    return f"{where} = {node!r}: {reason}"
