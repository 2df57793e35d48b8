"""examples/serve.toml shows today's defaults: every key it sets loads to the default value,
and every commented-out ``# key = value`` shows the default (or is unset by default), unless
its line says "not the default"."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import tomllib

from deltaserve.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "serve.toml"
MARK = "not the default"
#: a commented-out assignment: "# key = value   # comment"
COMMENTED = re.compile(r"^#\s*(\w+)\s*=\s*(.+?)(?:\s+#\s*(.*))?$")


def _plain(value: Any) -> Any:
    """Config values as TOML gives them (enums by value)."""
    return msgspec.to_builtins(value)


def _lines_by_section(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        m = re.match(r"^\[([\w.]+)\]", line)
        if m:
            section = m.group(1)
        out.setdefault(section, []).append(line)
    return out


def mismatches(text: str) -> list[str]:
    defaults = EngineConfig()
    loaded = EngineConfig.load(None, {})  # the no-file config, through the same loader
    assert _plain(defaults) == _plain(loaded)
    data = tomllib.loads(text)
    lines = _lines_by_section(text)
    bad: list[str] = []
    for section, keys in data.items():
        default = getattr(defaults, section)
        for key, value in keys.items():
            if key == "policy_options":
                continue
            line = next(x for x in lines[section] if re.match(rf"^{key}\s*=", x))
            want = _plain(getattr(default, key))
            # through the loader, as the file is loaded (a string becomes its enum, ...)
            one = EngineConfig.load(None, {f"{section}.{key}": value})
            got = _plain(getattr(getattr(one, section), key))
            if got != want and MARK not in line:
                bad.append(f"[{section}] {key} = {value!r}: the default is {want!r}")
    for section, section_lines in lines.items():
        if section not in data or section == "scheduler.policy_options":
            continue
        default = getattr(defaults, section)
        for line in section_lines:
            m = COMMENTED.match(line)
            if not m or not hasattr(default, m.group(1)) or MARK in line:
                continue
            want = _plain(getattr(default, m.group(1)))
            raw = tomllib.loads(f"v = {m.group(2)}")["v"]
            # through the loader too: a size written "256MiB" is the default 268435456
            one = EngineConfig.load(None, {f"{section}.{m.group(1)}": raw})
            shown = _plain(getattr(getattr(one, section), m.group(1)))
            if want is not None and shown != want:
                bad.append(f"[{section}] # {m.group(1)} = {shown!r}: the default is {want!r}")
    return bad


def test_serve_toml_shows_the_defaults() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    assert mismatches(text) == []
    # the placement is the real default, not pinned to the thread
    assert re.search(r'^core_process = "auto"', text, re.M)
    assert re.search(r'^checkpoint_granularity = "block"', text, re.M)


def test_the_check_catches_a_changed_default() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    pinned = text.replace('core_process = "auto"', 'core_process = "in_process"')
    assert mismatches(pinned) == ["[engine] core_process = 'in_process': the default is 'auto'"]
    commented = text.replace('# disk_bytes = "16GiB" ', '# disk_bytes = "100GiB"')
    assert commented != text
    assert mismatches(commented) == ["[cache] # disk_bytes = 107374182400: the default is 17179869184"]
    marked = pinned.replace('core_process = "in_process"', 'core_process = "in_process"  # not the default')
    assert mismatches(marked) == []
