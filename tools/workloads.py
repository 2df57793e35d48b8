"""Workloads shared by the live load generator and the cache-policy simulator. Torch-free.

A workload is a set of *sessions*. Each session starts with one root request; when a
request finishes, ``Workload.follow_ups(spec, reply_ids)`` returns the requests that
depend on its reply (none for independent requests, one for the next chat turn, several
where an agent trajectory branches), each to be sent ``delay_s`` after the reply (think
time, tool latency). The live load generator feeds it the replies the engine actually
generated; the simulator feeds ``synthetic_reply`` (deterministic, of the requested length).

Everything is deterministic under ``seed``: every piece of text comes from its own
``random.Random`` keyed by ``(seed, workload, what, session, turn, branch)``, so the
order in which concurrent sessions finish never changes what they send next.

Text is built from a fixed English word list, so a byte-level BPE tokenizer gives
realistic token counts; lengths are targets in tokens (the text stops at the first word
that reaches the target, so a prompt may run a few tokens over). Prompts go to the
engine as token ids, so every backend (engine, transformers, simulator) sees the same
tokens.

==================  ======================================================================
``chat``            N conversations x T turns; turn k+1 is the chat-template rendering of
                    the whole history including the reply actually generated; think time
``shared-prefix``   one long system prompt, unique questions
``prefix-repetition``  K prefixes x M suffixes each, shuffled
``shifted-prefix``  a shared prefix whose token length is not a multiple of the block
                    size, then long unique parts
``agent``           trajectories that grow by the model's outputs plus tool results and
                    branch into several continuations
``random``          no sharing (the control)
``trace``           replay a JSONL file of {arrival_s, prompt | prompt_token_ids |
                    messages, max_tokens} (optional: session, turn)
==================  ======================================================================
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
    "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
    "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more",
    "when", "will", "would", "who", "so", "no", "she", "other", "its", "may", "these", "what", "them",
    "than", "some", "him", "time", "into", "only", "do", "could", "new", "about", "two", "then",
    "first", "also", "after", "any", "like", "should", "our", "over", "such", "most", "where", "made",
    "very", "between", "years", "through", "work", "many", "before", "must", "people", "being",
    "well", "back", "still", "under", "while", "even", "water", "morning", "harbour", "village",
    "river", "garden", "engine", "model", "question", "answer", "story", "number", "system", "table",
    "window", "letter", "market", "teacher", "student", "library", "weather", "journey", "mountain",
    "kitchen", "summer", "winter", "evening", "island", "forest", "bridge", "station", "travel",
    "simple", "careful", "quiet", "bright", "green", "small", "large", "early", "late", "quickly",
    "slowly", "together", "always", "often", "never", "usually", "explain", "remember", "describe",
    "compare", "measure", "build", "write", "read", "find", "learn", "share", "count", "open",
    "close", "begin", "finish", "carry", "follow", "choose", "change", "return", "reason", "result",
    "method", "process", "request", "memory", "cache", "token", "batch", "prefix", "state", "layer",
    "value", "signal", "pattern", "detail", "example", "problem", "solution", "language", "history",
    "science", "music", "picture", "paper", "pencil", "school", "city", "country", "ocean", "boat",
    "fisherman", "daughter", "notebook", "clever", "gentle", "ancient", "modern", "common", "strange",
    "important", "possible", "different", "similar", "useful", "careful", "honest", "patient",
    "friendly", "happy", "tired", "ready", "because", "although", "however", "therefore", "perhaps",
    "almost", "enough", "across", "around", "behind", "beyond", "during", "without", "within",
    "against", "toward", "along", "among", "above", "below", "inside", "outside", "north", "south",
    "east", "west", "light", "sound", "color", "shape", "size", "speed", "distance", "direction",
    "energy", "power", "field", "space", "planet", "star", "moon", "cloud", "rain", "snow", "wind",
    "stone", "tree", "flower", "bird", "horse", "dog", "cat", "fox", "apple", "bread", "coffee",
    "tea", "music", "song", "dance", "game", "team", "player", "friend", "family", "house", "road",
)  # fmt: skip

DEFAULT_CONCURRENCY = 8
SLOT = "@@DELTASERVE_SLOT@@"


# ============================================================================ codecs
class Codec:
    """Text <-> token ids and chat rendering for one tokenizer."""

    name = "codec"
    vocab_size = 0

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return render_chatml(messages, add_generation_prompt)


def render_chatml(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class HFCodec(Codec):
    """A transformers tokenizer (the engine's ``engine.tokenizer``)."""

    def __init__(self, tokenizer: Any, name: str = "hf") -> None:
        self.tok = tokenizer
        self.name = name
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return render_chatml(messages, add_generation_prompt)


class TokenizersCodec(Codec):
    """``tokenizer.json`` of a Hugging Face folder through the ``tokenizers`` library and
    its chat template through jinja2: the same tokens as the engine, without torch."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(folder)
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.name = f"tokenizers:{folder.name}"
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        source = _read_chat_template(folder)
        if source:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )

            def raise_exception(message: str) -> None:
                raise ValueError(message)

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(source)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            return render_chatml(messages, add_generation_prompt)
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt)


def _read_chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        tmpl = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            tmpl = next((t.get("template") for t in tmpl if t.get("name") == "default"), None)
        if isinstance(tmpl, str):
            return tmpl
    return None


class SyntheticCodec(Codec):
    """A deterministic stand-in when no tokenizer folder exists (simulator only).

    Splits like a byte-level BPE pre-tokenizer (words with their leading space, digits,
    punctuation), then cuts each piece into 4-byte chunks hashed into the vocabulary:
    roughly the token counts of a small BPE vocabulary. Chat specials are ids 0..2.
    """

    name = "synthetic"
    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    _split = re.compile(r"[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

    def __init__(self, vocab_size: int = 1024) -> None:
        self.vocab_size = vocab_size
        self._strings: dict[int, str] = {i: s for i, s in enumerate(self.SPECIALS)}
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._special_re.split(text):
            if not part:
                continue
            if part in self.SPECIALS:
                ids.append(self.SPECIALS.index(part))
                continue
            for piece in self._split.findall(part):
                data = piece.encode()
                for i in range(0, len(data), 4):
                    chunk = data[i : i + 4]
                    tid = len(self.SPECIALS) + zlib.crc32(chunk) % (self.vocab_size - len(self.SPECIALS))
                    self._strings.setdefault(tid, chunk.decode(errors="replace"))
                    ids.append(tid)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._strings.get(i, "?") for i in ids)


def builtin_model_dir(name: str = "tiny-qwen3.5", version: str = "v1") -> Path:
    """Where ``models.builtin`` keeps a built-in model (computed without importing torch)."""
    root = os.environ.get("DELTASERVE_CACHE")
    base = Path(root) / "models" if root else Path.home() / ".cache" / "deltaserve" / "models"
    return base / f"{name}-{version}"


def load_codec(source: str | None = None) -> Codec:
    """A torch-free codec: a folder with tokenizer.json, ``builtin:NAME``, ``synthetic``,
    or (None) the built-in tiny model's tokenizer when it exists, else synthetic."""
    if source == "synthetic":
        return SyntheticCodec()
    if source is None or source.startswith("builtin:"):
        name = source.split(":", 1)[1] if source else "tiny-qwen3.5"
        folder = builtin_model_dir(name)
        if (folder / "tokenizer.json").is_file():
            return TokenizersCodec(folder)
        if source is None:
            return SyntheticCodec()
        raise FileNotFoundError(
            f"{source}: not built yet ({folder}); run the engine once, or use --tokenizer synthetic"
        )
    folder = Path(source)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    return TokenizersCodec(folder)


# ============================================================================ text
class TextMaker:
    """English-like text of a target token length, from ``WORDS``."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._ids: dict[str, list[int]] = {}

    def piece_ids(self, piece: str) -> list[int]:
        ids = self._ids.get(piece)
        if ids is None:
            ids = self._ids[piece] = self.codec.encode(piece)
        return ids

    def text(
        self,
        rng: random.Random,
        n_tokens: int,
        *,
        lead_space: bool = True,
        end: str = ".",
        distinct_first: set[int] | None = None,
    ) -> str:
        """About ``n_tokens`` tokens of sentences. ``distinct_first``: ids already used as
        a first token; the first word is drawn to start with a new one (and added)."""
        parts: list[str] = []
        total = 0
        left = 0
        while total < max(n_tokens, 1):
            if left == 0:
                left = rng.randint(6, 14)
            word = rng.choice(WORDS)
            first_of_sentence = not parts or parts[-1] in (".", "?")
            if first_of_sentence:
                word = word.capitalize()
            space = " " if (parts or lead_space) else ""
            if not parts and distinct_first is not None:
                for _ in range(200):
                    if self.piece_ids(space + word)[0] not in distinct_first:
                        break
                    word = rng.choice(WORDS).capitalize()
                distinct_first.add(self.piece_ids(space + word)[0])
            parts.append(space + word)
            total += len(self.piece_ids(space + word))
            left -= 1
            if left == 0 and total < n_tokens:
                parts.append(".")
                total += 1
        parts.append(end)
        return "".join(parts)


# ============================================================================ requests
@dataclass
class RequestSpec:
    """One request of a workload. ``prompt_ids`` is what every backend receives."""

    rid: str
    prompt_ids: list[int]
    max_tokens: int
    session: str = ""
    turn: int = 0
    branch: str = ""
    parent: str | None = None
    delay_s: float = 0.0  # after the parent's reply (think time / tool latency)
    arrival_s: float | None = None  # fixed arrival offset (trace)
    meta: dict[str, Any] = field(default_factory=dict)
    state: Any = field(default=None, repr=False)  # workload continuation, never serialized

    def describe(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "session": self.session,
            "turn": self.turn,
            "branch": self.branch,
            "parent": self.parent,
            "delay_s": self.delay_s,
            "arrival_s": self.arrival_s,
            "num_prompt_tokens": len(self.prompt_ids),
            "max_tokens": self.max_tokens,
            "prompt_hash": prompt_hash(self.prompt_ids),
            "meta": dict(self.meta),
        }


def prompt_hash(ids: Sequence[int]) -> str:
    return f"{zlib.crc32(json.dumps(list(ids)).encode()):08x}-{len(ids)}"


@dataclass
class WorkloadParams:
    """Knobs of every workload; ``None`` means the workload's own default."""

    name: str = "chat"
    seed: int = 0
    num_requests: int | None = None  # independent workloads
    sessions: int | None = None  # chat conversations / agent trajectories
    turns: int | None = None
    prefix_len: int | None = None  # shared prefix / system prompt, tokens
    prompt_len: int | None = None  # unique part / question / user message / task, tokens
    output_len: int | None = None  # max_tokens
    tool_len: int | None = None  # agent tool results, tokens
    num_prefixes: int | None = None
    suffixes_per_prefix: int | None = None
    branches: int | None = None  # agent: continuations at the fork
    branch_at: int | None = None  # agent: the turn whose reply forks
    think_time: float | None = None  # mean seconds between a reply and the next turn
    len_jitter: float | None = None  # unique-part lengths vary uniformly by +-this fraction
    block_size: int = 16  # the engine's KV block size (shifted-prefix avoids its multiples)
    chat_tokenize: str = "incremental"  # incremental: prompt_k + reply ids + new turn; full: re-tokenize
    trace: str | None = None
    time_scale: float = 1.0  # trace: arrival_s multiplier
    min_turns: int | None = None  # multi-turn / swe-agent: fewest turns (uniform in [min_turns, turns])
    session_prefix_len: int | None = None  # multi-turn: per-conversation prefix, mean tokens (lognormal)
    replies: str | None = None  # what the next turn re-sends: model | recorded | stripped
    depth: int | None = None  # tree: levels below the root
    beam: int | None = None  # tree: children of an expanded node that are expanded in turn
    tenants: int | None = None  # tenants: distinct system prompts
    volatile_every: int | None = None  # tenants: sessions of a tenant per change of the first line


@dataclass
class ArrivalParams:
    rate: float | None = None  # Poisson sessions/requests per second (open loop)
    concurrency: int | None = None  # sessions in flight (closed loop)


COMMON_DEFAULTS: dict[str, Any] = {"output_len": 32, "len_jitter": 0.2, "think_time": 0.0}


class Workload:
    name = ""
    multi_turn = False
    defaults: dict[str, Any] = {}
    #: sessions in flight when neither ``--rate`` nor ``--concurrency`` is given (None: the default)
    default_concurrency: int | None = None

    def __init__(self, params: WorkloadParams, codec: Codec) -> None:
        self.params = params
        self.codec = codec
        self.text = TextMaker(codec)
        given = {k: v for k, v in dataclasses.asdict(params).items() if v is not None}
        self.p: dict[str, Any] = {**COMMON_DEFAULTS, **self.defaults, **given, "name": self.name}
        self.seed = params.seed

    # ---------------------------------------------------------------- helpers
    def rng(self, *key: object) -> random.Random:
        return random.Random(f"{self.seed}:{self.name}:" + ":".join(map(str, key)))

    def jitter(self, rng: random.Random, n: int) -> int:
        j = float(self.p["len_jitter"])
        return max(1, round(n * rng.uniform(1 - j, 1 + j))) if j > 0 else max(1, n)

    def think(self, *key: object) -> float:
        mean = float(self.p["think_time"])
        return self.rng("think", *key).expovariate(1.0 / mean) if mean > 0 else 0.0

    def render(self, messages: Sequence[dict[str, str]], gen: bool = True) -> str:
        return self.codec.render_chat(messages, add_generation_prompt=gen)

    def render_split(self, messages: Sequence[dict[str, str]]) -> tuple[str, str]:
        """Rendering around the content ``SLOT`` of one message: (before, after)."""
        text = self.render(messages)
        i = text.index(SLOT)
        return text[:i], text[i + len(SLOT) :]

    # ---------------------------------------------------------------- API
    def roots(self) -> list[RequestSpec]:
        """Each session's first request (every request for independent workloads)."""
        raise NotImplementedError

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        """Requests that depend on ``spec``'s reply (sent ``delay_s`` after it)."""
        return []

    def expected_requests(self) -> int:
        return len(self.roots())

    def describe(self) -> dict[str, Any]:
        out = {k: v for k, v in self.p.items() if k not in ("trace",) or v is not None}
        out["multi_turn"] = self.multi_turn
        out["expected_requests"] = self.expected_requests()
        out["codec"] = self.codec.name
        return out


# ---------------------------------------------------------------------------- chat-like
@dataclass
class _History:
    messages: list[dict[str, str]]
    rendered: str  # the rendering (with generation prompt) the prompt ids came from


class _ChatLike(Workload):
    multi_turn = True

    def _first(self, messages: list[dict[str, str]]) -> tuple[list[int], _History]:
        rendered = self.render(messages)
        return self.codec.encode(rendered), _History(messages, rendered)

    def _extend(
        self, spec: RequestSpec, reply_ids: Sequence[int], new: list[dict[str, str]]
    ) -> tuple[list[int], _History]:
        """The next prompt: the whole history + the reply + ``new`` messages, rendered.

        ``incremental`` keeps the previous prompt's ids and the reply's ids as they are
        and tokenizes only the new text (what a token-in/token-out client sends; exact
        when the template renders history as a prefix); ``full`` re-tokenizes the whole
        rendering (what a text API does; the reply may tokenize differently)."""
        hist: _History = spec.state
        reply_text = self.codec.decode(reply_ids)
        messages = [*hist.messages, {"role": "assistant", "content": reply_text}, *new]
        rendered = self.render(messages)
        head = hist.rendered + reply_text
        if self.p["chat_tokenize"] == "incremental" and rendered.startswith(head):
            ids = list(spec.prompt_ids) + list(reply_ids) + self.codec.encode(rendered[len(head) :])
        else:
            ids = self.codec.encode(rendered)
        return ids, _History(messages, rendered)

    def _resent(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[int]:
        """The reply as the client puts it back into the history (``replies``).

        ``model``: the tokens the model generated, verbatim (agent loops, token-in/out
        clients). ``recorded``: the dataset's recorded answer, whatever the model said (vLLM's
        multi-turn benchmark replays a conversation file). ``stripped``: the model's reply
        with its leading reasoning (the first 70 %) stripped, as reasoning-model clients do.
        Only ``model`` lets an output checkpoint serve the next turn."""
        mode = self.p.get("replies") or "model"
        if mode == "model":
            return list(reply_ids)
        if mode == "stripped":
            return list(reply_ids[len(reply_ids) * 7 // 10 :]) or list(reply_ids[-1:])
        if mode == "recorded":
            rng = self.rng("recorded", spec.rid)
            return self.codec.encode(self.text.text(rng, max(len(reply_ids), 1)))
        raise ValueError(f"replies = {mode!r}: expected model, recorded or stripped")

    def _turns(self, *key: object) -> int:
        """Turns of one session: uniform in [min_turns, turns]."""
        hi = int(self.p["turns"])
        lo = min(int(self.p.get("min_turns") or hi), hi)
        return self.rng("turns", *key).randint(max(lo, 1), max(hi, 1))


def lognormal_tokens(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    """A heavy-tailed length with the given mean (before the cap)."""
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


class ChatWorkload(_ChatLike):
    name = "chat"
    defaults = {
        "sessions": 8,
        "turns": 5,
        "prefix_len": 128,
        "prompt_len": 64,
        "output_len": 48,
        "think_time": 0.5,
    }

    def _system(self) -> list[dict[str, str]]:
        n = int(self.p["prefix_len"])
        if n <= 0:
            return []
        return [{"role": "system", "content": self.text.text(self.rng("system"), n, lead_space=False)}]

    def roots(self) -> list[RequestSpec]:
        system = self._system()
        out = []
        for s in range(int(self.p["sessions"])):
            rng = self.rng("user", s, 0)
            user = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), lead_space=False, end="?")
            ids, hist = self._first([*system, {"role": "user", "content": user}])
            out.append(
                RequestSpec(
                    rid=f"chat-s{s}-t0", prompt_ids=ids, max_tokens=int(self.p["output_len"]),
                    session=f"chat-s{s}", turn=0, meta={"session_index": s}, state=hist,
                )
            )  # fmt: skip
        return out

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        s, t = spec.meta["session_index"], spec.turn + 1
        if t >= int(self.p["turns"]):
            return []
        rng = self.rng("user", s, t)
        user = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), lead_space=False, end="?")
        ids, hist = self._extend(spec, reply_ids, [{"role": "user", "content": user}])
        return [
            RequestSpec(
                rid=f"chat-s{s}-t{t}", prompt_ids=ids, max_tokens=int(self.p["output_len"]),
                session=spec.session, turn=t, parent=spec.rid, delay_s=self.think(s, t),
                meta={"session_index": s}, state=hist,
            )
        ]  # fmt: skip

    def expected_requests(self) -> int:
        return int(self.p["sessions"]) * int(self.p["turns"])


class AgentWorkload(_ChatLike):
    name = "agent"
    defaults = {
        "sessions": 4, "turns": 4, "prefix_len": 192, "prompt_len": 48, "output_len": 32,
        "tool_len": 64, "branches": 2, "branch_at": 1, "think_time": 0.1,
    }  # fmt: skip

    def roots(self) -> list[RequestSpec]:
        n = int(self.p["prefix_len"])
        tools = self.text.text(self.rng("system"), n, lead_space=False) if n > 0 else ""
        system = [{"role": "system", "content": "You can call tools. " + tools}] if n > 0 else []
        out = []
        for s in range(int(self.p["sessions"])):
            rng = self.rng("task", s)
            task = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), lead_space=False)
            ids, hist = self._first([*system, {"role": "user", "content": task}])
            out.append(
                RequestSpec(
                    rid=f"agent-s{s}-t0-b0", prompt_ids=ids, max_tokens=int(self.p["output_len"]),
                    session=f"agent-s{s}", turn=0, branch="0", meta={"session_index": s}, state=hist,
                )
            )  # fmt: skip
        return out

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        s, t = spec.meta["session_index"], spec.turn + 1
        if t >= int(self.p["turns"]):
            return []
        fork = spec.turn == int(self.p["branch_at"])
        out = []
        for b in range(int(self.p["branches"]) if fork else 1):
            branch = f"{spec.branch}.{b}" if fork else spec.branch
            rng = self.rng("tool", s, t, branch)
            result = self.text.text(rng, self.jitter(rng, int(self.p["tool_len"])), lead_space=False)
            tool = {"role": "tool", "content": f"<tool_response>\n{result}\n</tool_response>"}
            ids, hist = self._extend(spec, reply_ids, [tool])
            out.append(
                RequestSpec(
                    rid=f"agent-s{s}-t{t}-b{branch}", prompt_ids=ids, max_tokens=int(self.p["output_len"]),
                    session=spec.session, turn=t, branch=branch, parent=spec.rid,
                    delay_s=self.think(s, t, branch), meta={"session_index": s, "forked": fork}, state=hist,
                )
            )  # fmt: skip
        return out

    def expected_requests(self) -> int:
        turns, at, b = int(self.p["turns"]), int(self.p["branch_at"]), int(self.p["branches"])
        per = turns if at >= turns - 1 else (at + 1) + b * (turns - at - 1)
        return int(self.p["sessions"]) * per


# ---------------------------------------------------------------------------- pressure shapes
class _UserTurns(_ChatLike):
    """Conversations whose every follow-up is the (re-sent) reply plus a new user question,
    after a think time, for ``_turns(session)`` turns; request ids ``{rid_prefix}-s{S}-t{T}``."""

    rid_prefix = ""

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        s, t = spec.meta["session_index"], spec.turn + 1
        if t >= spec.meta["turns"]:
            return []
        rng = self.rng("user", s, t)
        user = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), lead_space=False, end="?")
        ids, hist = self._extend(spec, self._resent(spec, reply_ids), [{"role": "user", "content": user}])
        return [
            RequestSpec(
                rid=f"{self.rid_prefix}-s{s}-t{t}", prompt_ids=ids, max_tokens=self.jitter(rng, int(self.p["output_len"])),
                session=spec.session, turn=t, parent=spec.rid, delay_s=self.think(s, t),
                meta=spec.meta, state=hist,
            )
        ]  # fmt: skip

    def expected_requests(self) -> int:
        return sum(self._turns(s) for s in range(int(self.p["sessions"])))


class MultiTurnWorkload(_UserTurns):
    """The shape of vLLM's ``benchmarks/multi_turn`` synthetic conversations.

    Every conversation's first user message starts with a prefix common to all
    conversations (``prefix_len``) and a per-conversation prefix (``session_prefix_len``,
    lognormal, at most 5000 tokens); user turns of ``prompt_len`` (±``len_jitter``),
    answers of ``output_len``; ``min_turns``..``turns`` requests per conversation (vLLM's
    12-18 messages). The client replays a recorded conversation: the next turn re-sends
    the *recorded* answer (``replies = recorded``), not what the model said, so the model's
    output never comes back."""

    name = "multi-turn"
    rid_prefix = "mt"
    default_concurrency = 12
    defaults = {
        "sessions": 48, "turns": 9, "min_turns": 6, "prefix_len": 500, "session_prefix_len": 1000,
        "prompt_len": 140, "output_len": 100, "think_time": 5.0, "replies": "recorded",
    }  # fmt: skip

    def roots(self) -> list[RequestSpec]:
        common = self.text.text(self.rng("common"), int(self.p["prefix_len"]), lead_space=False)
        out = []
        for s in range(int(self.p["sessions"])):
            rng = self.rng("user", s, 0)
            own = self.text.text(rng, lognormal_tokens(rng, float(self.p["session_prefix_len"]), 0.8, 5000))
            question = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), end="?")
            ids, hist = self._first([{"role": "user", "content": common + own + question}])
            out.append(
                RequestSpec(
                    rid=f"mt-s{s}-t0", prompt_ids=ids, max_tokens=self.jitter(rng, int(self.p["output_len"])),
                    session=f"mt-s{s}", turn=0, meta={"session_index": s, "turns": self._turns(s)}, state=hist,
                )
            )  # fmt: skip
        return out


class SWEAgentWorkload(_ChatLike):
    """SWE-agent-like trajectories: a long system prompt with the tool documentation
    (shared by every trajectory), an issue to solve, then ``min_turns``..``turns`` steps of
    action (the model's output, re-sent as generated) and observation (a tool result of
    heavy-tailed length: lognormal with mean ``tool_len``, up to 8000 tokens), each after a
    tool latency (``think_time``)."""

    name = "swe-agent"
    default_concurrency = 10
    defaults = {
        "sessions": 20, "turns": 16, "min_turns": 8, "prefix_len": 2000, "prompt_len": 600,
        "output_len": 200, "tool_len": 300, "think_time": 1.0, "len_jitter": 0.5, "replies": "model",
    }  # fmt: skip

    def roots(self) -> list[RequestSpec]:
        docs = self.text.text(self.rng("system"), int(self.p["prefix_len"]), lead_space=False)
        system = {"role": "system", "content": "You are an autonomous programmer. Tools: " + docs}
        out = []
        for s in range(int(self.p["sessions"])):
            rng = self.rng("issue", s)
            issue = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), lead_space=False)
            ids, hist = self._first([system, {"role": "user", "content": "<issue>\n" + issue + "\n</issue>"}])
            out.append(
                RequestSpec(
                    rid=f"swe-s{s}-t0", prompt_ids=ids, max_tokens=self.jitter(rng, int(self.p["output_len"])),
                    session=f"swe-s{s}", turn=0, meta={"session_index": s, "turns": self._turns(s)}, state=hist,
                )
            )  # fmt: skip
        return out

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        s, t = spec.meta["session_index"], spec.turn + 1
        if t >= spec.meta["turns"]:
            return []
        rng = self.rng("observation", s, t)
        n = lognormal_tokens(rng, float(self.p["tool_len"]), 1.0, 8000)
        obs = {"role": "user", "content": "OBSERVATION:\n" + self.text.text(rng, n, lead_space=False)}
        ids, hist = self._extend(spec, self._resent(spec, reply_ids), [obs])
        return [
            RequestSpec(
                rid=f"swe-s{s}-t{t}", prompt_ids=ids, max_tokens=self.jitter(rng, int(self.p["output_len"])),
                session=spec.session, turn=t, parent=spec.rid, delay_s=self.think(s, t),
                meta=spec.meta, state=hist,
            )
        ]  # fmt: skip

    def expected_requests(self) -> int:
        return sum(self._turns(s) for s in range(int(self.p["sessions"])))


class TreeWorkload(_ChatLike):
    """Tree search (tree-of-thought / MCTS-style expansion): a problem, then every expanded
    node's reply (one reasoning step, re-sent verbatim) is continued by ``branches`` child
    requests that differ only in a short proposal hint; ``beam`` of each node's children are
    expanded in turn, down to ``depth`` levels. Siblings arrive together."""

    name = "tree"
    default_concurrency = 8
    defaults = {
        "sessions": 16, "prefix_len": 400, "prompt_len": 1500, "output_len": 300,
        "branches": 4, "beam": 1, "depth": 6, "think_time": 0.0,
    }  # fmt: skip

    def roots(self) -> list[RequestSpec]:
        system = {"role": "system", "content": self.text.text(self.rng("system"), int(self.p["prefix_len"]))}
        out = []
        for s in range(int(self.p["sessions"])):
            rng = self.rng("problem", s)
            problem = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), lead_space=False)
            ids, hist = self._first([system, {"role": "user", "content": problem}])
            out.append(
                RequestSpec(
                    rid=f"tree-s{s}-n", prompt_ids=ids, max_tokens=self.jitter(rng, int(self.p["output_len"])),
                    session=f"tree-s{s}", turn=0, branch="", meta={"session_index": s}, state=hist,
                )
            )  # fmt: skip
        return out

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        s, t = spec.meta["session_index"], spec.turn + 1
        if t > int(self.p["depth"]) or not spec.meta.get("expand", True):
            return []
        b, beam = int(self.p["branches"]), int(self.p["beam"])
        expanded = set(self.rng("beam", s, spec.branch).sample(range(b), min(beam, b)))
        out = []
        for k in range(b):
            rng = self.rng("step", s, spec.branch, k)
            hint = {
                "role": "user",
                "content": f"Proposal {k + 1}: " + self.text.text(rng, 8, lead_space=False),
            }
            ids, hist = self._extend(spec, self._resent(spec, reply_ids), [hint])
            branch = f"{spec.branch}.{k}"
            out.append(
                RequestSpec(
                    rid=f"tree-s{s}-n{branch}", prompt_ids=ids,
                    max_tokens=self.jitter(rng, int(self.p["output_len"])), session=spec.session, turn=t,
                    branch=branch, parent=spec.rid, delay_s=self.think(s, branch),
                    meta={"session_index": s, "expand": k in expanded}, state=hist,
                )
            )  # fmt: skip
        return out

    def expected_requests(self) -> int:
        b, beam, depth = (
            int(self.p["branches"]),
            min(int(self.p["beam"]), int(self.p["branches"])),
            int(self.p["depth"]),
        )
        per = 1 + sum(b * beam ** (level - 1) for level in range(1, depth + 1))
        return int(self.p["sessions"]) * per


class TenantsWorkload(_UserTurns):
    """Multi-tenant chat: ``tenants`` long system prompts (Zipf popularity) whose first line
    is volatile — a timestamp that changes every ``volatile_every`` sessions of a tenant, so
    nothing is shared across that line's versions — then short conversations of
    ``min_turns``..``turns`` turns."""

    name = "tenants"
    rid_prefix = "tenant"
    default_concurrency = 24
    defaults = {
        "sessions": 128, "tenants": 16, "volatile_every": 4, "prefix_len": 3000, "prompt_len": 200,
        "output_len": 150, "turns": 3, "min_turns": 1, "think_time": 2.0, "len_jitter": 0.3,
    }  # fmt: skip

    def roots(self) -> list[RequestSpec]:
        n_tenants = max(int(self.p["tenants"]), 1)
        weights = [1.0 / (k + 1) ** 1.1 for k in range(n_tenants)]
        bodies = []
        for k in range(n_tenants):
            rng = self.rng("system", k)
            bodies.append(self.text.text(rng, self.jitter(rng, int(self.p["prefix_len"]))))
        seen = [0] * n_tenants
        out = []
        for s in range(int(self.p["sessions"])):
            rng = self.rng("user", s, 0)
            k = rng.choices(range(n_tenants), weights)[0]
            epoch = seen[k] // max(int(self.p["volatile_every"]), 1)
            seen[k] += 1
            first = f"Tenant {k}. Current time: day {epoch // 24} {epoch % 24:02d}:00 UTC."
            user = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), lead_space=False, end="?")
            ids, hist = self._first([{"role": "system", "content": first + "\n" + bodies[k]},
                                     {"role": "user", "content": user}])  # fmt: skip
            out.append(
                RequestSpec(
                    rid=f"tenant-s{s}-t0", prompt_ids=ids, max_tokens=self.jitter(rng, int(self.p["output_len"])),
                    session=f"tenant-s{s}", turn=0,
                    meta={"session_index": s, "tenant": k, "epoch": epoch, "turns": self._turns(s)}, state=hist,
                )
            )  # fmt: skip
        return out


# ---------------------------------------------------------------------------- independent
class SharedPrefixWorkload(Workload):
    name = "shared-prefix"
    defaults = {"num_requests": 16, "prefix_len": 512, "prompt_len": 48}

    def roots(self) -> list[RequestSpec]:
        system = self.text.text(self.rng("system"), int(self.p["prefix_len"]), lead_space=False)
        before, after = self.render_split(
            [{"role": "system", "content": system}, {"role": "user", "content": SLOT}]
        )
        prefix = self.codec.encode(before)
        used: set[int] = set()
        out = []
        for i in range(int(self.p["num_requests"])):
            rng = self.rng("question", i)
            q = self.text.text(
                rng,
                self.jitter(rng, int(self.p["prompt_len"])),
                lead_space=False,
                end="?",
                distinct_first=used,
            )
            out.append(
                RequestSpec(
                    rid=f"shared-{i}", prompt_ids=prefix + self.codec.encode(q + after),
                    max_tokens=int(self.p["output_len"]), session=f"shared-{i}", meta={"prefix_tokens": len(prefix)},
                )
            )  # fmt: skip
        return out


class PrefixRepetitionWorkload(Workload):
    name = "prefix-repetition"
    defaults = {"num_prefixes": 4, "suffixes_per_prefix": 4, "prefix_len": 256, "prompt_len": 48}

    def roots(self) -> list[RequestSpec]:
        firsts: set[int] = set()
        out = []
        for k in range(int(self.p["num_prefixes"])):
            rng = self.rng("prefix", k)
            prefix_text = self.text.text(rng, int(self.p["prefix_len"]), distinct_first=firsts)
            prefix = self.codec.encode(prefix_text)
            used: set[int] = set()
            for m in range(int(self.p["suffixes_per_prefix"])):
                rng = self.rng("suffix", k, m)
                suffix = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), distinct_first=used)
                out.append(
                    RequestSpec(
                        rid=f"prep-p{k}-s{m}", prompt_ids=prefix + self.codec.encode(suffix),
                        max_tokens=int(self.p["output_len"]), session=f"prep-p{k}-s{m}",
                        meta={"prefix": k, "suffix": m, "prefix_tokens": len(prefix)},
                    )
                )  # fmt: skip
        self.rng("shuffle").shuffle(out)
        return out


class ShiftedPrefixWorkload(Workload):
    name = "shifted-prefix"
    defaults = {"num_requests": 12, "prefix_len": 300, "prompt_len": 256}

    def roots(self) -> list[RequestSpec]:
        rng = self.rng("prefix")
        text = self.text.text(rng, int(self.p["prefix_len"]))
        prefix = self.codec.encode(text)
        bs = max(int(self.p["block_size"]), 1)
        while len(prefix) % bs == 0:  # the point of this workload: the prefix ends mid-block
            text = text[:-1] + " " + rng.choice(WORDS) + "."
            prefix = self.codec.encode(text)
        used: set[int] = set()
        out = []
        for i in range(int(self.p["num_requests"])):
            rng = self.rng("unique", i)
            part = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), distinct_first=used)
            out.append(
                RequestSpec(
                    rid=f"shifted-{i}", prompt_ids=prefix + self.codec.encode(part),
                    max_tokens=int(self.p["output_len"]), session=f"shifted-{i}", meta={"prefix_tokens": len(prefix)},
                )
            )  # fmt: skip
        return out


class RandomWorkload(Workload):
    name = "random"
    defaults = {"num_requests": 16, "prompt_len": 256}

    def roots(self) -> list[RequestSpec]:
        used: set[int] = set()
        out = []
        for i in range(int(self.p["num_requests"])):
            rng = self.rng("prompt", i)
            text = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), distinct_first=used)
            out.append(
                RequestSpec(
                    rid=f"random-{i}", prompt_ids=self.codec.encode(text),
                    max_tokens=int(self.p["output_len"]), session=f"random-{i}",
                )
            )  # fmt: skip
        return out


#: tokens per ``hash_ids`` entry of a Mooncake trace
MOONCAKE_BLOCK_TOKENS = 512


class TraceWorkload(Workload):
    """Replay a JSONL trace. Two row formats:

    * ours: ``{arrival_s, prompt | prompt_token_ids | messages, max_tokens}`` (optional
      ``request_id``, ``session``, ``turn``);
    * Mooncake's (FAST'25 traces): ``{timestamp (ms), input_length, output_length,
      hash_ids}``, where each hash id names one 512-token block and equal ids mean equal
      prefixes. The tokens of a hash id are synthesized deterministically (a generator
      seeded by the id), so requests sharing leading hash ids share exactly that prefix;
      the prompt is the blocks' tokens cut to ``input_length``.
    """

    name = "trace"
    defaults: dict[str, Any] = {}

    def __init__(self, params: WorkloadParams, codec: Codec) -> None:
        super().__init__(params, codec)
        self._blocks: dict[int, list[int]] = {}

    def block_tokens(self, hash_id: int) -> list[int]:
        """The 512 synthesized tokens of one Mooncake hash id (deterministic, not under ``seed``)."""
        ids = self._blocks.get(hash_id)
        if ids is None:
            rng = random.Random(f"mooncake:{hash_id}")
            hi = max(self.codec.vocab_size, 1024)
            ids = self._blocks[hash_id] = [rng.randrange(3, hi) for _ in range(MOONCAKE_BLOCK_TOKENS)]
        return ids

    def _mooncake_prompt(self, row: dict[str, Any]) -> list[int]:
        n = int(row["input_length"])
        ids: list[int] = []
        for h in row["hash_ids"]:
            ids += self.block_tokens(int(h))
        if len(ids) < n:  # a trace whose input outgrows its hash ids: fill from the request's own stream
            rng = random.Random(f"mooncake:tail:{row.get('timestamp')}:{n}")
            ids += [rng.randrange(3, max(self.codec.vocab_size, 1024)) for _ in range(n - len(ids))]
        return ids[:n]

    def roots(self) -> list[RequestSpec]:
        path = self.p.get("trace")
        if not path:
            raise ValueError("the trace workload needs --trace FILE (JSONL of {arrival_s, prompt | "
                             "prompt_token_ids | messages, max_tokens} or Mooncake's {timestamp, "
                             "input_length, output_length, hash_ids})")  # fmt: skip
        scale = float(self.p["time_scale"])
        out = []
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: {e}") from None
            arrival = float(row.get("arrival_s", 0.0))
            max_tokens = int(row.get("max_tokens", self.p["output_len"]))
            if "hash_ids" in row:
                try:
                    ids = self._mooncake_prompt(row)
                    arrival = float(row.get("timestamp", 0.0)) / 1000.0
                    max_tokens = max(int(row.get("output_length", max_tokens)), 1)
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{i + 1}: bad Mooncake row ({e})") from None
            elif "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
            elif "messages" in row:
                ids = self.codec.encode(self.render(row["messages"]))
            elif "prompt" in row:
                ids = self.codec.encode(str(row["prompt"]))
            else:
                raise ValueError(f"{path}:{i + 1}: needs prompt, prompt_token_ids, messages or hash_ids")
            out.append(
                RequestSpec(
                    rid=str(row.get("request_id", f"trace-{i}")), prompt_ids=ids, max_tokens=max_tokens,
                    session=str(row.get("session", f"trace-{i}")), turn=int(row.get("turn", 0)),
                    arrival_s=arrival * scale, meta={"line": i + 1},
                )
            )  # fmt: skip
        out.sort(key=lambda r: r.arrival_s or 0.0)
        return out


WORKLOADS: dict[str, type[Workload]] = {
    cls.name: cls
    for cls in (
        ChatWorkload,
        SharedPrefixWorkload,
        PrefixRepetitionWorkload,
        ShiftedPrefixWorkload,
        AgentWorkload,
        RandomWorkload,
        TraceWorkload,
        MultiTurnWorkload,
        SWEAgentWorkload,
        TreeWorkload,
        TenantsWorkload,
    )
}
#: the shapes of issue 11: more conversations than the pools hold (``--workload pressure``)
PRESSURE_WORKLOADS = ("multi-turn", "swe-agent", "tree", "tenants")


def make_workload(params: WorkloadParams, codec: Codec) -> Workload:
    try:
        cls = WORKLOADS[params.name]
    except KeyError:
        raise ValueError(f"unknown workload {params.name!r}; known: {', '.join(WORKLOADS)}") from None
    return cls(params, codec)


# ============================================================================ replies, walking
def synthetic_reply(workload: Workload, spec: RequestSpec) -> list[int]:
    """Deterministic reply of exactly ``spec.max_tokens`` tokens (English-like words)."""
    rng = workload.rng("reply", spec.rid)
    ids: list[int] = []
    while len(ids) < spec.max_tokens:
        ids += workload.text.piece_ids(" " + rng.choice(WORDS))
    return ids[: spec.max_tokens]


def expand(
    workload: Workload, reply: Callable[[Workload, RequestSpec], list[int]] = synthetic_reply
) -> list[tuple[RequestSpec, list[int]]]:
    """Every request of the workload with its reply, breadth first (no timing)."""
    queue = deque(workload.roots())
    out: list[tuple[RequestSpec, list[int]]] = []
    while queue:
        spec = queue.popleft()
        ids = reply(workload, spec)
        out.append((spec, ids))
        queue.extend(workload.follow_ups(spec, ids))
    return out


def plan_arrivals(
    roots: Sequence[RequestSpec], arrival: ArrivalParams, seed: int, *, default_concurrency: int | None = None
) -> dict[str, Any]:
    """How roots arrive: ``{"mode": "poisson"|"trace"|"closed", "times": [...]|None, "concurrency"}``.

    ``--rate`` gives Poisson arrivals of sessions (times drawn from ``seed``); otherwise
    ``--concurrency`` a closed loop; otherwise a trace's own ``arrival_s``; otherwise a
    closed loop of ``default_concurrency`` (the workload's, else ``DEFAULT_CONCURRENCY``)
    sessions."""
    if arrival.rate is not None:
        if arrival.rate <= 0:
            raise ValueError("--rate must be > 0")
        rng = random.Random(f"{seed}:arrivals")
        t, times = 0.0, []
        for _ in roots:
            times.append(t)
            t += rng.expovariate(arrival.rate)
        return {"mode": "poisson", "rate": arrival.rate, "times": times, "concurrency": None}
    if arrival.concurrency is not None:
        if arrival.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        return {"mode": "closed", "rate": None, "times": None, "concurrency": arrival.concurrency}
    if roots and all(r.arrival_s is not None for r in roots):
        return {"mode": "trace", "rate": None, "times": [r.arrival_s for r in roots], "concurrency": None}
    n = default_concurrency or DEFAULT_CONCURRENCY
    return {"mode": "closed", "rate": None, "times": None, "concurrency": n}


# ============================================================================ CLI
def add_workload_args(parser: argparse.ArgumentParser, *, default: str = "chat", multi: bool = False) -> None:
    g = parser.add_argument_group("workload")
    names = ", ".join(WORKLOADS)
    if multi:
        g.add_argument(
            "--workload", default=default,
            help=f"comma list, 'all' (the small shapes) or 'pressure' ({', '.join(PRESSURE_WORKLOADS)}) of: {names}",
        )  # fmt: skip
    else:
        g.add_argument(
            "--workload", default=default, choices=list(WORKLOADS), help="workload (default %(default)s)"
        )
    g.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    g.add_argument("--num-requests", type=int, help="requests of an independent workload")
    g.add_argument("--sessions", type=int, help="chat conversations / agent trajectories")
    g.add_argument("--turns", type=int, help="turns per conversation / steps per trajectory")
    g.add_argument("--prefix-len", type=int, help="shared prefix / system prompt, tokens")
    g.add_argument("--prompt-len", type=int, help="unique part / question / user turn / task, tokens")
    g.add_argument("--output-len", type=int, help="max_tokens of every request")
    g.add_argument("--tool-len", type=int, help="agent tool results, tokens")
    g.add_argument("--num-prefixes", type=int, help="prefix-repetition: K prefixes")
    g.add_argument("--suffixes-per-prefix", type=int, help="prefix-repetition: M suffixes each")
    g.add_argument("--branches", type=int, help="agent: continuations at the fork")
    g.add_argument("--branch-at", type=int, help="agent: the turn whose reply forks the trajectory")
    g.add_argument(
        "--think-time", type=float, help="mean seconds between a reply and the next turn (exponential)"
    )
    g.add_argument("--len-jitter", type=float, help="unique lengths vary by +- this fraction (default 0.2)")
    g.add_argument(
        "--chat-tokenize", choices=["incremental", "full"], default="incremental",
        help="next turn = previous prompt ids + reply ids + new turn (incremental) or a re-tokenized rendering",
    )  # fmt: skip
    g.add_argument("--min-turns", type=int, help="multi-turn, swe-agent, tenants: fewest turns of a session")
    g.add_argument("--session-prefix-len", type=int, help="multi-turn: per-conversation prefix (mean tokens)")
    g.add_argument(
        "--replies", choices=["model", "recorded", "stripped"],
        help="what the next turn re-sends: the model's reply, a recorded one, or the reply with reasoning stripped",
    )  # fmt: skip
    g.add_argument("--depth", type=int, help="tree: levels below the root")
    g.add_argument("--beam", type=int, help="tree: children of an expanded node that are expanded")
    g.add_argument("--tenants", type=int, help="tenants: distinct system prompts")
    g.add_argument(
        "--volatile-every", type=int, help="tenants: sessions per change of the volatile first line"
    )
    g.add_argument(
        "--trace", metavar="FILE",
        help="trace workload: JSONL to replay ({arrival_s, prompt|prompt_token_ids|messages, max_tokens} "
        "or Mooncake's {timestamp, input_length, output_length, hash_ids})",
    )  # fmt: skip
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival_s by this")
    a = parser.add_argument_group("arrivals")
    a.add_argument("--rate", type=float, help="open loop: Poisson arrivals of sessions/requests per second")
    a.add_argument(
        "--concurrency", type=int, help=f"closed loop: sessions in flight (default {DEFAULT_CONCURRENCY})"
    )


def workload_names(spec: str) -> list[str]:
    """``all``: the small shapes (every workload but trace and the pressure shapes);
    ``pressure``: ``PRESSURE_WORKLOADS``; else a comma list."""
    if spec == "all":
        names = [n for n in WORKLOADS if n != "trace" and n not in PRESSURE_WORKLOADS]
    elif spec == "pressure":
        names = list(PRESSURE_WORKLOADS)
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if n not in WORKLOADS:
            raise ValueError(f"unknown workload {n!r}; known: {', '.join(WORKLOADS)}")
    return names


def params_from_args(
    args: argparse.Namespace, name: str | None = None, block_size: int = 16
) -> WorkloadParams:
    return WorkloadParams(
        name=name or args.workload,
        seed=args.seed,
        num_requests=args.num_requests,
        sessions=args.sessions,
        turns=args.turns,
        prefix_len=args.prefix_len,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        tool_len=args.tool_len,
        num_prefixes=args.num_prefixes,
        suffixes_per_prefix=args.suffixes_per_prefix,
        branches=args.branches,
        branch_at=args.branch_at,
        think_time=args.think_time,
        len_jitter=args.len_jitter,
        block_size=block_size,
        chat_tokenize=args.chat_tokenize,
        trace=args.trace,
        time_scale=args.time_scale,
        min_turns=args.min_turns,
        session_prefix_len=args.session_prefix_len,
        replies=args.replies,
        depth=args.depth,
        beam=args.beam,
        tenants=args.tenants,
        volatile_every=args.volatile_every,
    )


def arrival_from_args(args: argparse.Namespace) -> ArrivalParams:
    return ArrivalParams(rate=args.rate, concurrency=args.concurrency)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


__all__ = [
    "DEFAULT_CONCURRENCY",
    "PRESSURE_WORKLOADS",
    "WORDS",
    "WORKLOADS",
    "ArrivalParams",
    "Codec",
    "HFCodec",
    "RequestSpec",
    "SyntheticCodec",
    "TextMaker",
    "TokenizersCodec",
    "Workload",
    "WorkloadParams",
    "add_workload_args",
    "arrival_from_args",
    "builtin_model_dir",
    "common_prefix_len",
    "expand",
    "load_codec",
    "make_workload",
    "params_from_args",
    "plan_arrivals",
    "prompt_hash",
    "synthetic_reply",
    "workload_names",
]
