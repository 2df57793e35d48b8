#!/usr/bin/env python
"""Generate ``docs/config.md`` from the config structs in ``engine/config.py``.

    python tools/gen_config_docs.py            # (re)write docs/config.md
    python tools/gen_config_docs.py --check    # exit 1 if docs/config.md is stale

One table per section (``[model]``, ``[cache]``, ``[scheduler]``, ``[kernels]``, ``[engine]``,
``[logging]``): key, type with its constraints (``int ≥ 1``, ``float in (0, 1]``, enum
values), default and meaning, read from the fields' ``Annotated`` types and their
``msgspec.Meta(description=...)``; each section's class docstring is its introduction.
``tests/test_docs.py`` fails when the file and the structs disagree.

Never imports torch (``deltaserve.engine.config`` is torch-free).
"""

from __future__ import annotations

import argparse
import enum
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from deltaserve.engine.byte_size import format_bytes, is_bytes_type
from deltaserve.engine.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "docs" / "config.md"
COMMAND = "python tools/gen_config_docs.py"

HEADER = f"""\
# Configuration reference

<!-- Generated from engine/config.py by `{COMMAND}`: do not edit by hand.
     tests/test_docs.py fails when this file is stale. -->

"""

INTRO = """\
A config file is TOML, JSON or YAML (by extension) with the sections below; every key is
optional. Load it with `EngineConfig.load("examples/serve.toml", overrides={"scheduler.policy": "lpm"})`;
every tool takes `--config FILE` and `--set section.key=value` (the value is read as a TOML
literal). Loading is strict: an unknown key, a wrong type or an out-of-range value raises
`ConfigError` naming the key and the value. Building the structs in code
(`EngineConfig(cache=CacheConfig(block_size=32))`) runs the same checks.
A commented starting point: [`examples/serve.toml`](../examples/serve.toml).

Types: `int ≥ 1` etc. are the accepted ranges; `A | None` means the key may be left out
(there is no `null` in TOML: leave the key out, or pass `--set key=none`); enum values are
listed as the strings the file takes.

Sizes: a key of type `bytes` takes an integer or a string with a unit, in a file, in `--set`
and in code (`CacheConfig(memory_bytes="4GiB")`): `KiB`, `MiB`, `GiB`, `TiB` (or `Ki`, `Mi`,
`Gi`, `Ti`) are binary (powers of 1024); `KB`, `MB`, `GB`, `TB` (any case) are decimal
(powers of 1000), as vLLM and disk vendors write them. A bare letter follows vLLM's
`human_readable_int`: upper case `K`, `M`, `G`, `T` are binary (`4G` = 4 GiB, as in
`docker --memory 4G`), lower case `k`, `m`, `g`, `t` decimal (`100k` = 100,000). `B` or no unit:
bytes. A fraction is allowed with a unit (`1.5GiB`, rounded down to whole bytes); a negative or
unknown size (`-1GiB`, `4XB`) is a `ConfigError` naming the key.
"""

# Facts that follow from several keys (kept here, next to the tables they explain).
NOTES = {
    "cache": """\
The **checkpoint unit** is where a hit can end: one block by default
(`checkpoint_granularity = "block"`: a shared prefix of 100 tokens reuses 96 with block 16; a
tail, branch or output capture off the GDN kernel's 64-token chunks costs one partial chunk),
or lcm(`block_size`, 64) tokens with `"chunk"` (captures free, a hit covers whole units: 64 of
those 100). Interval checkpoints stay on multiples of lcm(`block_size`, 64). `engine.ready`
logs the unit and the sizes the budget gave (`kv_tokens`, `live_slots`, `checkpoint_slots`,
`max_model_len`).
""",
}


# ---------------------------------------------------------------------------- rendering
def _md(text: str) -> str:
    """reStructuredText literals (``x``) as Markdown code spans (`x`)."""
    return text.replace("``", "`")


def _cell(text: str) -> str:
    """Table-safe: no pipes or newlines that would break the row."""
    return text.replace("|", "\\|").replace("\n", " ")


def _number(value: float, *, bound: bool = False) -> str:
    """``2^63 − 1`` for huge limits; a bound as short as it goes (``1``), a default as in TOML (``1.0``)."""
    if bound and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= 2**31:
        for shift in range(31, 65):
            if value == 2**shift - 1:
                return f"2^{shift} − 1"
            if value == 2**shift:
                return f"2^{shift}"
    return str(value)


def _range(name: str, t: Any) -> str:
    lo = hi = None
    lo_open = hi_open = False
    if t.ge is not None:
        lo = t.ge
    elif t.gt is not None:
        lo, lo_open = t.gt, True
    if t.le is not None:
        hi = t.le
    elif t.lt is not None:
        hi, hi_open = t.lt, True
    if lo is not None and hi is not None:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        return f"{name} in {left}{_number(lo, bound=True)}, {_number(hi, bound=True)}{right}"
    if lo is not None:
        return f"{name} {'>' if lo_open else '≥'} {_number(lo, bound=True)}"
    if hi is not None:
        return f"{name} {'<' if hi_open else '≤'} {_number(hi, bound=True)}"
    return name


def type_name(t: mi.Type) -> str:
    """A readable type with its constraints: ``int ≥ 1``, ``float in (0, 1]``, enum values."""
    if isinstance(t, mi.Metadata):
        if (t.extra or {}).get("unit") == "bytes" and isinstance(t.type, mi.IntType):
            return _range("bytes", t.type)
        return type_name(t.type)
    if isinstance(t, mi.UnionType):
        return " | ".join(type_name(a) for a in t.types)
    if isinstance(t, mi.NoneType):
        return "None"
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.IntType):
        return _range("int", t)
    if isinstance(t, mi.FloatType):
        return _range("float", t)
    if isinstance(t, mi.StrType):
        if t.min_length == 1 and t.max_length is None:
            return "str (non-empty)"
        return "str"
    if isinstance(t, mi.EnumType):
        return " | ".join(f'"{m.value}"' for m in t.cls)
    if isinstance(t, mi.DictType):
        return f"table of {type_name(t.key_type)} → {type_name(t.value_type)}"
    if isinstance(t, mi.AnyType):
        return "any"
    if isinstance(t, mi.ListType):
        return f"list of {type_name(t.item_type)}"
    raise TypeError(f"gen_config_docs: no rendering for {t!r}; add one")


def default_literal(value: Any) -> str:
    """The default as it would be written in TOML (``None``: the key is left out)."""
    if value is None:
        return "unset"  # rendered without code quotes: it is not a value a file can hold
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (int, float)):
        return _number(value)
    if isinstance(value, dict):
        return (
            "{}"
            if not value
            else "{ " + ", ".join(f"{k} = {default_literal(v)}" for k, v in value.items()) + " }"
        )
    return repr(value)


def _default(field: mi.Field) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    raise TypeError(f"config field {field.name!r} has no default")


def _description(field: mi.Field) -> str:
    t = field.type
    schema = t.extra_json_schema if isinstance(t, mi.Metadata) else None
    text = (schema or {}).get("description")
    if not text:
        raise ValueError(f"config field {field.name!r} has no msgspec.Meta(description=...)")
    return text


def sections() -> list[tuple[str, type]]:
    """``(name, struct class)`` of every section, in ``EngineConfig``'s order."""
    return [(f.name, f.type) for f in msgspec.structs.fields(EngineConfig)]


def render() -> str:
    """The whole of docs/config.md."""
    out = [HEADER, INTRO]
    names = ", ".join(f"[`[{name}]`](#{name})" for name, _ in sections())
    out.append(f"\nSections: {names}.\n")
    for name, cls in sections():
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        out.append(f"\n## [{name}]\n\n")
        out.append(_md(inspect.cleandoc(cls.__doc__ or "")) + "\n\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|\n")
        for f in info.fields:
            default = _default(f)
            if isinstance(default, int) and default > 0 and is_bytes_type(f.type):
                default = format_bytes(default)  # shown as a file would write it: "256MiB"
            row = (
                f"`{f.name}`",
                f"`{type_name(f.type)}`",
                "*unset*" if default is None else f"`{default_literal(default)}`",
                _md(_description(f)),
            )
            out.append("| " + " | ".join(_cell(c) for c in row) + " |\n")
        if name in NOTES:
            out.append("\n" + NOTES[name])
    return re.sub(r"\n{3,}", "\n\n", "".join(out))


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale; write nothing")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="default: docs/config.md")
    args = parser.parse_args(argv)
    text = render()
    current = args.output.read_text(encoding="utf-8") if args.output.is_file() else None
    if args.check:
        if current != text:
            print(f"{args.output} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    sys.exit(run_tool(main, "gen_config_docs"))
