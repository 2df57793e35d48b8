"""Conversations: the chat-template history machinery every multi-turn workload shares
(``_ChatLike``, ``_UserTurns``), and the ``chat`` and ``multi-turn`` workloads.

A follow-up's prompt is the whole history, the reply (as the client re-sends it) and the new
messages, rendered with the codec's chat template.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from deltaserve.tools.workloads.request import RequestSpec
from deltaserve.tools.workloads.workload import Workload


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


class _UserTurns(_ChatLike):
    """Conversations whose every follow-up is the (re-sent) reply plus a new message (a user
    question unless ``_next_message`` says otherwise), after a think time, for
    ``_turns(session)`` turns; request ids ``{rid_prefix}-s{S}-t{T}``."""

    rid_prefix = ""
    next_rng = "user"  # the random stream of each follow-up: rng(next_rng, session, turn)

    def _next_message(self, rng: random.Random) -> dict[str, str]:
        user = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), lead_space=False, end="?")
        return {"role": "user", "content": user}

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        s, t = spec.meta["session_index"], spec.turn + 1
        if t >= spec.meta["turns"]:
            return []
        rng = self.rng(self.next_rng, s, t)
        ids, hist = self._extend(spec, self._resent(spec, reply_ids), [self._next_message(rng)])
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
