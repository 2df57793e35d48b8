"""Tokenizer codecs: text <-> token ids and chat rendering, torch-free.

``HFCodec`` wraps the engine's transformers tokenizer; ``TokenizersCodec`` reads a Hugging Face
folder's ``tokenizer.json`` and chat template (the same tokens, no torch); ``SyntheticCodec`` is
a deterministic stand-in, only when asked for. ``load_codec`` picks one: by default the built-in
models' tokenizer, built without torch where no built-in model was built, so a workload has the
same token ids on every machine.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deltaserve.models.builtin_tokenizer import (
    DEFAULT_BUILTIN,
    builtin_model_dir,
    check_builtin_name,
    ensure_builtin_tokenizer,
)


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


def load_codec(source: str | None = None) -> Codec:
    """A torch-free codec: a folder with tokenizer.json, ``synthetic``, or (None or
    ``builtin:NAME``) the built-in models' tokenizer: the model folder's when it was built,
    else the same tokenizer built alone (``ensure_builtin_tokenizer``)."""
    if source == "synthetic":
        return SyntheticCodec()
    if source is None or source.startswith("builtin:"):
        name = source.split(":", 1)[1] if source else DEFAULT_BUILTIN
        check_builtin_name(name)
        folder = builtin_model_dir(name)
        if not (folder / "tokenizer.json").is_file():
            folder = ensure_builtin_tokenizer()  # every built-in model ships this one
        return TokenizersCodec(folder)
    folder = Path(source)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    return TokenizersCodec(folder)
