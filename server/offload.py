"""Long prompts are rendered and tokenized off the event loop.

Tokenizing runs at about 0.1 s per 100k characters: on the event loop that would stall every
stream the server is sending. A prompt longer than ``LONG_PROMPT_CHARS`` (its text, or its
messages' contents) is rendered and tokenized in one worker thread, with its own copy of the
tokenizer (``InputProcessor.for_another_thread``), and reaches the engine as token ids, which
build the same request. Shorter prompts stay on the loop: a thread hop would cost more than it
saves. A request that brings its own ``chat_template`` is rendered there too, whatever its
length: the template is the client's code, and however long it takes to render (the Jinja
sandbox bounds ``range``, not loops) it must not hold the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deltaserve.engine.front.client import EngineClient
from deltaserve.engine.front.input_processor import InputProcessor

#: prompts longer than this (characters) are tokenized in the worker thread
LONG_PROMPT_CHARS = 8192


def prompt_chars(prompt: Any) -> int:
    """Characters of a text prompt or of chat messages' contents (token ids: 0)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return sum(len(m.get("content") or "") for m in prompt if isinstance(m, dict))
    return 0


class Tokenizer:
    """The server's tokenizing thread (module docstring); ``close()`` at shutdown."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self._pool: ThreadPoolExecutor | None = None
        self._processor: InputProcessor | None = None

    async def ids_if_long(self, prompt: Any, extras: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """``(prompt, extras)`` as given, or for a long prompt ``(its token ids, {})`` (the
        template arguments are spent rendering it). Raises the input processor's typed errors."""
        if prompt_chars(prompt) <= LONG_PROMPT_CHARS and "chat_template" not in extras:
            return prompt, extras
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-tokenize")
            self._processor = self.engine.input_processor.for_another_thread()
        assert self._processor is not None
        processor = self._processor
        ids = await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: processor.tokenize(prompt, **extras)
        )
        return ids, {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
