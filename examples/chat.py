#!/usr/bin/env python
"""A multi-turn streaming chat with ``AsyncEngine`` that keeps the conversation as token ids.

    python examples/chat.py                        # 4 scripted user turns on the built-in model
    python examples/chat.py --turns 2 --max-tokens 16
    python examples/chat.py --interactive          # type the user turns (an empty line ends)
    python examples/chat.py --set model.device=cuda --set logging.level=warning

Turn N+1's prompt is turn N's prompt ids + the ids the model generated + the next user
message rendered in the chat template, so it starts with exactly the tokens the engine
has cached and resumes from there: each turn prints how many prompt tokens came from the
prefix cache (``RequestOutput.num_cached_tokens``). Hits come in whole checkpoint units
(lcm(block_size, 64) tokens), so the count is a multiple of 64 at most the prompt's length.

Re-rendering the conversation as text each turn (``generate(messages)``) can lose those
hits: a chat template may render the previous assistant turn differently from what the
model generated (strip its reasoning, re-serialise tool calls), and text tokenized anew
can merge differently across the turn boundary; the hit stops where the ids diverge.

Only the chat goes to stdout; engine logs go to stderr at ``logging.level``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deltaserve import AsyncEngine, SamplingParams, install_uvloop
from deltaserve.engine.cli import add_config_args, config_from_args
from deltaserve.logs import configure_logging

SYSTEM = (
    "You are a helpful assistant for a small village library. Answer briefly and clearly. "
    "The library opens at nine o'clock and closes at six; children may borrow up to five books, "
    "adults up to ten, for three weeks. Late books cost ten cents a day. The reading room is "
    "quiet, the garden is open in summer, and the librarian's name is Mrs. Fisher."
)
USER_TURNS = (
    "Hello! When does the library open?",
    "How many books may my daughter borrow?",
    "And what happens if we bring them back late?",
    "Thank you. Who should I ask for when we arrive?",
)
PROBE = "\x1fassistant-probe\x1f"  # a marker no template alters


class Conversation:
    """The whole conversation as token ids: exactly what the model read and wrote."""

    def __init__(self, tokenizer: Any, system: str) -> None:
        self.tokenizer = tokenizer
        self.system = system
        self.ids: list[int] = []
        # The token the template closes a turn with ("<|im_end|>" in Qwen's ChatML), which is
        # also the token the model stops on.
        self.end_of_turn = tokenizer.eos_token
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(self.end_of_turn)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def add_user(self, text: str) -> list[int]:
        """Append a user message and the generation prompt; the prompt ids of the next turn."""
        if not self.ids:  # first turn: render the template as usual
            messages = [{"role": "system", "content": self.system}, {"role": "user", "content": text}]
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            self.ids = self._encode(rendered)
        else:  # later turns: only the new text, after the ids we already have
            self.ids += self._encode(self._after_assistant_turn(text))
        return list(self.ids)

    def add_reply(self, token_ids: list[int]) -> None:
        """Append the ids the model generated (ending with the end-of-turn token when it stopped
        there; a reply cut short by max_tokens is closed the way the template closes a turn)."""
        self.ids += token_ids
        if not token_ids or token_ids[-1] != self.end_of_turn_id:
            self.ids.append(self.end_of_turn_id)

    def _after_assistant_turn(self, text: str) -> str:
        """What the chat template writes after an assistant turn's end-of-turn token when the
        user speaks next, up to the next reply (ChatML: "\\n<|im_start|>user\\n{text}<|im_end|>\\n
        <|im_start|>assistant\\n"). Found by rendering a probe conversation: the text after
        the probe reply's end-of-turn token."""
        probe = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": PROBE},
            {"role": "user", "content": text},
        ]
        rendered = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        end = rendered.index(self.end_of_turn, rendered.index(PROBE)) + len(self.end_of_turn)
        return rendered[end:]


def user_turns(args: argparse.Namespace) -> Iterator[str]:
    if args.interactive:
        while True:
            try:
                line = input("user: ").strip()
            except EOFError:
                return
            if not line:
                return
            yield line
    else:
        for i in range(args.turns):
            text = USER_TURNS[i % len(USER_TURNS)]
            print(f"user: {text}")
            yield text


async def chat(args: argparse.Namespace) -> None:
    config = config_from_args(args)  # --config (default: examples/serve.toml) and --set
    configure_logging(config.logging.level.value)  # deltaserve logs -> stderr; stdout is the chat
    async with AsyncEngine(config) as engine:
        conversation = Conversation(engine.tokenizer, SYSTEM)
        print(f"system: {SYSTEM}")
        for turn, text in enumerate(user_turns(args), start=1):
            prompt_ids = conversation.add_user(text)
            params = SamplingParams(
                max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=args.seed + turn
            )
            reply: list[int] = []
            last = None
            print("assistant: ", end="", flush=True)
            async for out in engine.generate(prompt_ids, params):
                print(out.text, end="", flush=True)
                reply += out.token_ids
                last = out
            print()
            assert last is not None and last.finished
            if last.finish_reason == "error":
                raise SystemExit(f"request failed: {last.error}")
            conversation.add_reply(reply)
            print(
                f"[turn {turn}: {last.num_prompt_tokens} prompt tokens, {last.num_cached_tokens} cached, "
                f"{len(reply)} generated ({last.finish_reason})]",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=len(USER_TURNS), help="scripted user turns (default 4)")
    parser.add_argument("--max-tokens", type=int, default=48, help="most tokens per reply (default 48)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of turn 1 (turn N: seed + N)")
    parser.add_argument("--interactive", action="store_true", help="read the user turns from stdin")
    add_config_args(parser)
    args = parser.parse_args(argv)
    if args.config is None:
        default = Path(__file__).with_name("serve.toml")
        args.config = str(default) if default.is_file() else None
    install_uvloop()
    asyncio.run(chat(args))


if __name__ == "__main__":
    sys.exit(main())
