"""Agent trajectories: ``agent`` (grows by outputs and tool results, forks into branches) and
``swe-agent`` (a long tool-documentation prompt, heavy-tailed observations)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from deltaserve.tools.workloads.chat import _ChatLike, _UserTurns, lognormal_tokens
from deltaserve.tools.workloads.request import RequestSpec


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


class SWEAgentWorkload(_UserTurns):
    """SWE-agent-like trajectories: a long system prompt with the tool documentation
    (shared by every trajectory), an issue to solve, then ``min_turns``..``turns`` steps of
    action (the model's output, re-sent as generated) and observation (a tool result of
    heavy-tailed length: lognormal with mean ``tool_len``, up to 8000 tokens), each after a
    tool latency (``think_time``)."""

    name = "swe-agent"
    rid_prefix = "swe"
    next_rng = "observation"
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

    def _next_message(self, rng: random.Random) -> dict[str, str]:
        n = lognormal_tokens(rng, float(self.p["tool_len"]), 1.0, 8000)
        return {"role": "user", "content": "OBSERVATION:\n" + self.text.text(rng, n, lead_space=False)}
