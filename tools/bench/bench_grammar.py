"""Grammar engines for constrained decoding, measured side by side: xgrammar and llguidance.

For each tokenizer (the built-in model's 1,024-token BPE, and a ~150k vocabulary made from it
by adding plain-text tokens, as no real-size tokenizer is available offline) it prints:

* compile: schema -> a ready matcher, cold (a fresh compiler, the first mask included: both
  engines finish parts of the work lazily) and cached (xgrammar's compiler cache; llguidance
  has no compile step to cache, so its "cached" is a matcher built from the same grammar);
* mask: the time to fill the token bitmask of a batch of 64 matchers, per decode step (median
  over the steps of a valid instance), each matcher advancing by the instance's tokens.

Run: ``python -m deltaserve.tools.bench.bench_grammar [--batch 64] [--big-vocab 150000]``.
Both packages must be installed for the comparison (only xgrammar is a dependency of
deltaserve; ``--engines xgrammar`` runs it alone). Every step's token is checked to be accepted
by every matcher, so the masks are timed on a valid path.

Measured on the development machine (2 CPU cores, batch 64; ms): xgrammar compiles a schema in
1.7-3.0 (1,024 tokens) / 28-32 (~150k) cold, 0.04-0.09 cached, and fills the batch's masks in
0.11-0.12 per step at either size; llguidance in 1.3-2.1 cold, 0.6-1.6 for a new matcher, and
0.28-0.75 per step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, spread, timed


def _object(properties: dict[str, Any], required: list[str], **extra: Any) -> dict[str, Any]:
    """A JSON-schema object (``type``, ``properties``, ``required``, then ``extra``, in that order)."""
    return {"type": "object", "properties": properties, "required": required, **extra}


def _typed(**types: str | list[str]) -> dict[str, dict[str, Any]]:
    """Properties of plain types: ``name="string"`` -> ``{"name": {"type": "string"}}``."""
    return {name: {"type": t} for name, t in types.items()}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _object(
        _typed(name="string", age="integer", email="string", admin="boolean"),
        ["name", "age", "email", "admin"],
        additionalProperties=False,
    ),
    "order": _object(
        {
            "id": {"type": "string"},
            "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
            "items": {
                "type": "array",
                "items": _object(
                    {
                        "sku": {"type": "string"},
                        "qty": {"type": "integer", "minimum": 1},
                        "price": {"type": "number"},
                    },
                    ["sku", "qty", "price"],
                ),
            },
            "address": _object(_typed(street="string", city="string", zip="string"), ["street", "city"]),
        },
        ["id", "status", "items", "address"],
    ),
    "tool_calls": {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                _object(
                    {
                        "name": {"const": f"fn_{k}"},
                        "parameters": _object(_typed(arg0="string", arg1="integer", arg2="number"), ["arg0"]),
                    },
                    ["name", "parameters"],
                )
                for k in range(4)
            ]
        },
    },
    "wide": _object(
        {f"field_{k}": {"type": ["string", "integer", "boolean"][k % 3]} for k in range(30)},
        [f"field_{k}" for k in range(30)],
    ),
}

INSTANCES: dict[str, Any] = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "admin": True},
    "order": {
        "id": "A-1029",
        "status": "paid",
        "items": [{"sku": "X1", "qty": 2, "price": 9.5}, {"sku": "Y22", "qty": 1, "price": 120.0}],
        "address": {"street": "1 Main St", "city": "Springfield", "zip": "01101"},
    },
    "tool_calls": [{"name": "fn_2", "parameters": {"arg0": "weather in Paris", "arg1": 3}}],
    "wide": {f"field_{k}": ["value", 7, False][k % 3] for k in range(30)},
}


@dataclass
class Row:
    engine: str
    vocab: int
    schema: str
    cold_ms: float
    cached_ms: float
    mask_ms: dict[str, float]  # ms per step: harness.spread over the steps


def big_tokenizer(base: Any, size: int) -> Any:
    """``base`` with plain-text tokens added up to ``size`` (word-like pieces, printable ASCII
    without spaces, so byte-level decoding leaves them as they are)."""
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits
    words: set[str] = set()
    need = size - len(base)
    while len(words) < need:
        n = rng.choice([2, 3, 4, 5, 6, 7, 8, 10])
        words.add("".join(rng.choice(alphabet) for _ in range(n)))
    base.add_tokens(sorted(words))
    return base


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Milliseconds of one call, and its value."""
    seconds, value = timed(fn)
    return seconds * 1e3, value


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.threads = threads
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile_times(self, schema: dict[str, Any]) -> tuple[float, float, Any]:
        xgr = self.xgr
        compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads)
        text = json.dumps(schema)

        def build() -> Any:
            compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
            m = xgr.GrammarMatcher(compiled)
            m.fill_next_token_bitmask(xgr.allocate_token_bitmask(1, self.info.vocab_size))
            return compiled

        cold, compiled = _time(build)
        cached, _ = _time(build)
        return cold, cached, compiled

    def mask_ms(self, compiled: Any, tokens: list[int], batch: int) -> dict[str, float]:
        xgr = self.xgr
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgr.allocate_token_bitmask(batch, self.info.vocab_size)
        times = []
        for t in tokens:
            ms, _ = _time(lambda: self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask))
            times.append(ms)
            for m in matchers:
                assert m.accept_token(t)
        return spread(times)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.vocab = len(tokenizer)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile_times(self, schema: dict[str, Any]) -> tuple[float, float, Any]:
        ll = self.ll
        grammar = ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )

        def build() -> Any:
            m = ll.LLMatcher(self.tok, grammar)
            assert not m.is_error(), m.get_error()
            self.llt.fill_next_token_bitmask(m, self.llt.allocate_token_bitmask(1, self.vocab))
            return grammar

        cold, _ = _time(build)
        cached, _ = _time(build)
        return cold, cached, grammar

    def mask_ms(self, grammar: Any, tokens: list[int], batch: int) -> dict[str, float]:
        matchers = [self.ll.LLMatcher(self.tok, grammar) for _ in range(batch)]
        bitmask = self.llt.allocate_token_bitmask(batch, self.vocab)
        pairs = [(m, i) for i, m in enumerate(matchers)]
        times = []
        for t in tokens:
            ms, _ = _time(lambda: self.llt.fill_next_token_bitmask_par(self.executor, pairs, bitmask))
            times.append(ms)
            for m in matchers:
                assert m.consume_token(t), m.get_error()
        return spread(times)


ENGINES: dict[str, type[XGrammar] | type[LLGuidance]] = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def run(tokenizer: Any, batch: int, threads: int, engines: list[str]) -> list[Row]:
    rows = []
    for cls in (ENGINES[e] for e in engines):
        engine = cls(tokenizer, threads)
        for name, schema in SCHEMAS.items():
            cold, cached, compiled = engine.compile_times(schema)
            text = json.dumps(INSTANCES[name])
            tokens = tokenizer.encode(text, add_special_tokens=False)
            mask = engine.mask_ms(compiled, tokens, batch)
            rows.append(Row(engine.name, len(tokenizer), name, cold, cached, mask))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--big-vocab", type=int, default=150_000, help="0: only the built-in tokenizer")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--engines", default="xgrammar,llguidance", help="comma-separated: xgrammar, llguidance")
    args = ap.parse_args(argv)
    bench = Bench("bench_grammar", args)
    torch.set_num_threads(1)
    from deltaserve.models.builtin import build_tokenizer

    tokenizers = [build_tokenizer()]
    if args.big_vocab:
        tokenizers.append(big_tokenizer(build_tokenizer(), args.big_vocab))
    print(f"batch {args.batch}, {args.threads} threads")
    print(
        f"{'engine':<11} {'vocab':>7} {'schema':<11} {'compile cold ms':>15} {'cached ms':>10} {'mask/step ms':>12}"
    )
    rows = []
    for tok in tokenizers:
        for r in run(tok, args.batch, args.threads, args.engines.split(",")):
            print(
                f"{r.engine:<11} {r.vocab:>7} {r.schema:<11} {r.cold_ms:>15.2f} {r.cached_ms:>10.3f}"
                f" {r.mask_ms['median']:>12.3f}  ({r.mask_ms['min']:.3f}-{r.mask_ms['max']:.3f})"
            )
            rows.append(dataclasses.asdict(r))
    print("(mask/step: median over the instance's steps, min-max)")
    print(describe_box(bench.before))
    bench.write(args.json, rows)


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_grammar")
