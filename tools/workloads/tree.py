"""The ``tree`` workload: tree search, siblings continuing one shared parent."""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.tools.workloads.chat import _ChatLike
from deltaserve.tools.workloads.request import RequestSpec


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
