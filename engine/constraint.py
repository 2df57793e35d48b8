"""Constraint: what a request's output must match (``SamplingParams.constraint``).

A constraint is a kind and its spec, checked on construction by parsing the spec into a
tokenizer-independent grammar (xgrammar), so an invalid schema, regex or grammar fails when
the request is built (``InvalidRequestError`` naming the field), never in a step. Compiling it
against the model's vocabulary is ``engine/grammar.py``'s job (off every loop, with a deadline).

A spec's size is bounded before anything parses it (``SchemaLimits``): the compile of some
shapes grows much faster than their text (xgrammar on this CPU: 600 optional properties of one
object 0.5 s, 1,000 4.4 s, 3,000 about 100 s; a 1 MB enum 15 s; a 200-deep schema 1.7 s just to
parse), so a schema past a limit is refused at once with a message naming the limit, and
what passes compiles in seconds at most.

Construction validates once, at the front door: a struct decoded under ``trusted_decode()``
(the engine-core process receiving what its front end validated) is not checked again.

JSON kinds bound whitespace (no free whitespace, ``", "`` and ``": "`` separators), and an
integer without bounds gets I-JSON's interoperable range (``|n| <= 2**53 - 1``), so a model that
would rather emit spaces or digits still reaches the end of the value. (Strings stay unbounded
unless the schema bounds them: ``maxLength``.)
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import json
import re
from collections.abc import Iterator
from typing import Any

import msgspec

from deltaserve.engine.errors import InvalidRequestError

MAX_SPEC_CHARS = 1 << 20  # a schema / regex / grammar of at most 1 MiB of text
MAX_CHOICES = 1024
MAX_MARKER_BYTES = 64  # a ``starts_after`` marker is a tag (``engine/grammar_gate.py``)
JSON_SEPARATORS = (", ", ": ")
# xgrammar prefixes its messages with "[time] path/file.cc:line: "
SAFE_INTEGER = 2**53 - 1  # RFC 7493 (I-JSON): integers beyond this do not round-trip
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_STRING_SHAPES = {"pattern", "format", "enum", "const"}
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


#: set while a trusted peer's message is decoded (``trusted_decode``): validation is skipped
_TRUSTED: contextvars.ContextVar[bool] = contextvars.ContextVar("deltaserve_trusted_decode", default=False)


@contextlib.contextmanager
def trusted_decode() -> Iterator[None]:
    """Structs built inside this block (a msgspec decode of what a front end already validated)
    skip their ``__post_init__`` checks: a request is validated once, where it enters."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def is_trusted() -> bool:
    """Whether validation is skipped here (``trusted_decode``)."""
    return _TRUSTED.get()


class SchemaLimits:
    """The most a JSON schema (and a choice list) may hold; what passes compiles in seconds.

    ``depth``: nesting of the schema document's JSON containers (a schema nested 60 levels as
    objects is about 120); ``properties``: one object's ``properties``; ``branches``: one
    ``anyOf`` / ``oneOf`` / ``allOf`` / ``prefixItems`` list; ``enum_items``: one ``enum``;
    ``literal_chars``: the characters of every ``enum`` / ``const`` string of the schema (or
    of every choice) together.
    """

    depth = 128
    properties = 1024
    branches = 256
    enum_items = 1024
    literal_chars = 128 * 1024


class ConstraintKind(enum.Enum):
    """What the spec is: a JSON schema (JSON text), any JSON object (no spec), a regular
    expression, a list of allowed strings, or an EBNF grammar (xgrammar's dialect, GBNF-like)."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


class Constraint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A constraint on a request's output, validated on creation, then immutable.

    ``spec``: for ``JSON_SCHEMA`` the schema as JSON text, for ``REGEX`` / ``GRAMMAR`` the
    pattern / grammar text, for ``CHOICE`` a non-empty list of non-empty strings; ``JSON_OBJECT``
    takes none. Errors name ``SamplingParams.constraint.spec`` (or ``.kind``).

    ``starts_after``: the constraint holds only from the first token after the output's text
    contains this marker (a reasoning model's ``"</think>"``); before it every token but the
    stop tokens (and the padding ids) is allowed, and the marker must end at a token boundary
    (``engine/grammar_gate.py``). None: from the first token.
    """

    kind: ConstraintKind
    spec: str | list[str] | None = None
    starts_after: str | None = None

    def __post_init__(self) -> None:
        if _TRUSTED.get():
            return
        if not isinstance(self.kind, ConstraintKind):
            raise InvalidRequestError(
                f"SamplingParams.constraint.kind={self.kind!r}: must be a ConstraintKind"
            )
        if self.starts_after is not None and not (
            isinstance(self.starts_after, str) and 0 < len(self.starts_after.encode()) <= MAX_MARKER_BYTES
        ):
            raise InvalidRequestError(
                f"SamplingParams.constraint.starts_after={self.starts_after!r}: "
                f"must be a string of 1 to {MAX_MARKER_BYTES} bytes"
            )
        build_grammar(self)

    @property
    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint (the compile cache's key: ``starts_after``
        is not in it, since the compiled grammar is the same; the matcher differs)."""
        spec = self.spec if isinstance(self.spec, str) or self.spec is None else json.dumps(self.spec)
        return self.kind.value, spec or ""


def _fail(what: str) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.constraint.spec: {what}")


def _native_message(e: Exception) -> str:
    return _NATIVE_PREFIX.sub("", str(e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _text_spec(c: Constraint) -> str:
    if not isinstance(c.spec, str) or not c.spec:
        raise _fail(f"a {c.kind.value} constraint needs a non-empty string")
    if len(c.spec) > MAX_SPEC_CHARS:
        raise _fail(f"is {len(c.spec)} characters; at most {MAX_SPEC_CHARS}")
    return c.spec


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string literals are valid
    EBNF string literals: the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)


def _normalise(node: Any) -> Any:
    """``node`` with every unbounded ``"type": "integer"`` given the interoperable range, and
    every length-bounded plain string given the same bounds as a pattern: xgrammar 0.2.8 builds
    ``minLength`` / ``maxLength`` from a character class that lets control characters into the
    string (invalid JSON); its pattern strings are JSON-escaped correctly."""
    if isinstance(node, list):
        return [_normalise(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _normalise(v) for k, v in node.items()}
    kind = out.get("type")
    if kind == "integer" and not any(b in out for b in _BOUNDS):
        out["minimum"], out["maximum"] = -SAFE_INTEGER, SAFE_INTEGER
    if kind == "string" and ("minLength" in out or "maxLength" in out) and not _STRING_SHAPES & out.keys():
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^[^\\x00-\\x1f]{{{lo},{hi}}}$"
    return out


_BRANCH_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")


def check_schema_size(schema: Any) -> None:
    """Raise ``InvalidRequestError`` naming the first ``SchemaLimits`` bound ``schema`` (parsed
    JSON) passes. One walk without recursion: its own depth is what it checks."""
    lim = SchemaLimits
    chars = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > lim.depth:
            raise _fail(f"the JSON schema nests deeper than {lim.depth} levels")
        if isinstance(node, list):
            stack.extend((x, depth + 1) for x in node)
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > lim.properties:
            raise _fail(f"an object of the JSON schema has {len(props)} properties; at most {lim.properties}")
        for key in _BRANCH_KEYS:
            branches = node.get(key)
            if isinstance(branches, list) and len(branches) > lim.branches:
                raise _fail(f"a {key} of the JSON schema has {len(branches)} entries; at most {lim.branches}")
        enum_ = node.get("enum")
        if isinstance(enum_, list):
            if len(enum_) > lim.enum_items:
                raise _fail(f"an enum of the JSON schema has {len(enum_)} values; at most {lim.enum_items}")
            chars += sum(len(v) for v in enum_ if isinstance(v, str))
        const = node.get("const")
        if isinstance(const, str):
            chars += len(const)
        if chars > lim.literal_chars:
            raise _fail(
                f"the enum and const strings of the JSON schema exceed {lim.literal_chars} characters"
            )
        stack.extend((v, depth + 1) for v in node.values())


def bounded_schema(text: str) -> str:
    """The JSON schema the grammar is built from (``_normalise``)."""
    return json.dumps(_normalise(json.loads(text)))


def build_grammar(c: Constraint) -> Any:
    """The constraint's tokenizer-independent ``xgrammar.Grammar`` (raises InvalidRequestError
    naming the spec)."""
    import xgrammar as xgr

    kind = c.kind
    try:
        if kind is ConstraintKind.JSON_OBJECT:
            if c.spec:
                raise _fail("a json_object constraint takes no spec")
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS
            )
        if kind is ConstraintKind.CHOICE:
            spec = c.spec
            if not isinstance(spec, list) or not spec or not all(isinstance(s, str) and s for s in spec):
                raise _fail("a choice constraint needs a non-empty list of non-empty strings")
            if len(spec) > MAX_CHOICES:
                raise _fail(f"has {len(spec)} choices; at most {MAX_CHOICES}")
            chars = sum(map(len, spec))
            if chars > SchemaLimits.literal_chars:
                raise _fail(f"the choices hold {chars} characters; at most {SchemaLimits.literal_chars}")
            return xgr.Grammar.from_ebnf(choice_ebnf(spec))
        text = _text_spec(c)
        if kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise _fail(f"the JSON schema is not valid JSON: {e}") from None
            except RecursionError:
                raise _fail(f"the JSON schema nests deeper than {SchemaLimits.depth} levels") from None
            if not isinstance(schema, (dict, bool)):
                raise _fail("the JSON schema must be a JSON object")
            check_schema_size(schema)
            return xgr.Grammar.from_json_schema(
                bounded_schema(text), any_whitespace=False, separators=JSON_SEPARATORS
            )
        if kind is ConstraintKind.REGEX:
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except InvalidRequestError:
        raise
    except Exception as e:  # the native parser's message says what is wrong and where
        raise _fail(f"invalid {kind.value}: {_native_message(e)}") from None
