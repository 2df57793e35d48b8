"""Byte sizes with units: ``4GiB``, ``512MB``, ``1.5GiB``, ``4G``, ``100k``: one parser for every size.

Every config key that holds bytes (the ``*_bytes`` keys of ``[cache]``, ``server.max_body_bytes``)
and every tool flag that takes bytes accepts an integer or a string with a unit, read by
``parse_bytes``. The units (docs/config.md, "Sizes"):

* ``KiB MiB GiB TiB`` (and ``Ki Mi Gi Ti``): binary, powers of 1024;
* ``KB MB GB TB`` (any case, ``kB`` too): decimal, powers of 1000;
* a bare letter as vLLM's ``human_readable_int`` reads it: upper case ``K M G T`` binary
  (``4G`` = 4 GiB, as ``docker --memory 4G`` and ``-Xmx4G``), lower case ``k m g t`` decimal
  (``100k`` = 100,000);
* ``B`` or no unit: bytes.

A fraction is allowed with a unit (``1.5GiB``) and rounded down to whole bytes. A negative,
empty or unknown size (``-1GiB``, ``4XB``, ``abc``) is a ``ConfigError`` naming the key and
the value. A field is a size when its type carries ``BYTES`` metadata (``PosBytes``,
``NonNegBytes``); ``size_fields`` lists them for the loaders and constructors. Torch-free.
"""

from __future__ import annotations

import argparse
import functools
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

import msgspec
import msgspec.inspect as mi

from deltaserve.engine.errors import ConfigError

#: the metadata that marks a config field as a byte size
BYTES = {"unit": "bytes"}
PosBytes = Annotated[int, msgspec.Meta(ge=1, extra=BYTES)]
NonNegBytes = Annotated[int, msgspec.Meta(ge=0, extra=BYTES)]

_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)")
UNITS_HINT = "an integer, or a number with a unit: 4GiB, 512MiB (binary), 4GB, 512MB (decimal), 4G (= 4GiB)"


def _multiplier(unit: str) -> int | None:
    """Bytes per ``unit``; None when it is not one."""
    if unit in ("", "B", "b"):
        return 1
    if len(unit) == 1:  # vLLM's rule: upper case binary, lower case decimal
        letter = unit.lower()
        if letter not in _BINARY:
            return None
        return _BINARY[letter] if unit.isupper() else _DECIMAL[letter]
    low = unit.lower()
    letter = low[0]
    if letter not in _BINARY:
        return None
    if low[1:] in ("ib", "i"):
        return _BINARY[letter]
    if low[1:] == "b":
        return _DECIMAL[letter]
    return None


def parse_bytes(value: object, key: str) -> int:
    """``value`` (an int, or a string with an optional unit) as a whole number of bytes.

    Raises a one-line ``ConfigError`` naming ``key`` and ``value`` when it is not a size or is
    negative; range limits (``>= 1``) are the caller's (the field's type)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: not a size; expected {UNITS_HINT}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key} = {value!r}: a size cannot be negative")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{key} = {value!r}: not a size; expected {UNITS_HINT}")
    text = value.strip().replace("_", "")
    m = _SIZE.fullmatch(text)
    mult = _multiplier(m.group("unit")) if m else None
    if m is None or mult is None:
        why = "a size cannot be negative" if text.startswith("-") else f"not a size; expected {UNITS_HINT}"
        raise ConfigError(f"{key} = {value!r}: {why}")
    try:
        number = Decimal(m.group("num"))
    except InvalidOperation:  # the pattern admits only decimal digits; kept for safety
        raise ConfigError(f"{key} = {value!r}: not a size; expected {UNITS_HINT}") from None
    return int(number * mult)


def format_bytes(n: int) -> str:
    """``n`` in the largest binary unit that shows it exactly (``268435456`` -> ``256MiB``), else
    in the largest unit it reaches with one decimal (``1.3KiB``), else in bytes (``7B``)."""
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= mult:
            return f"{n / mult:.1f}{unit}"
    return f"{n}B"


def is_bytes_type(t: mi.Type) -> bool:
    """Whether a field's (inspected) type carries the ``BYTES`` marker anywhere."""
    if isinstance(t, mi.Metadata):
        return (t.extra or {}).get("unit") == "bytes" or is_bytes_type(t.type)
    if isinstance(t, mi.UnionType):
        return any(is_bytes_type(a) for a in t.types)
    return False


@functools.cache
def size_fields(cls: type) -> frozenset[str]:
    """The names of ``cls``'s fields that hold byte sizes."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return frozenset(f.name for f in info.fields if is_bytes_type(f.type))


def bytes_arg(text: str) -> int:
    """An ``argparse`` type for a flag that takes bytes: ``--cache-bytes 4GiB``."""
    try:
        return parse_bytes(text, "value")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value = ")) from None
