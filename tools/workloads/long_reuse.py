"""The ``long-reuse`` workload: production-shaped conversations whose next turn comes back
only after hundreds of other requests.

Many conversations run interleaved, open loop: sessions arrive as a Poisson process
(``session_rate`` per second, drawn from the seed: the roots carry ``arrival_s``, so the
simulator and loadgen replay them at those times unless ``--rate`` / ``--concurrency``
say otherwise), and a conversation's next turn follows its reply after a think time from
a lognormal with a heavy tail (``think_time`` mean, ``think_sigma``): most users answer
within minutes, some after an hour. With ``session_rate`` x mean turns requests per second
arriving, a turn's prefix is reused after ``think time x request rate`` other requests —
hundreds at the defaults (``reuse_distances`` measures it).

Shape (multi-turn production chat): ``tenants`` apps, each with its own system prompt
(about ``prefix_len`` tokens, Zipf popularity) shared by its sessions; a first user
message with a pasted document or code (lognormal, mean ``session_prefix_len``); user
turns of lognormal length (mean ``prompt_len``) and replies of lognormal length (mean
``output_len``) that grow the context; 1 + geometric turns (mean about 1 / (1 -
``turn_continue``)), at most ``turns``. The next turn re-sends the model's reply
(``replies``, default ``model``).
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Sequence

from deltaserve.tools.workloads.chat import _UserTurns, lognormal_tokens
from deltaserve.tools.workloads.request import RequestSpec


class LongReuseWorkload(_UserTurns):
    name = "long-reuse"
    rid_prefix = "lr"
    defaults = {
        "sessions": 800, "tenants": 8, "prefix_len": 1000, "session_prefix_len": 1000,
        "prompt_len": 200, "output_len": 200, "turns": 16, "turn_continue": 0.7,
        "think_time": 600.0, "think_sigma": 1.0, "session_rate": 0.6, "len_jitter": 0.2,
    }  # fmt: skip

    def _turns(self, *key: object) -> int:
        """1 + geometric(``turn_continue``) turns, capped at ``turns`` (heavy-ish: most
        conversations are short, a few go on)."""
        rng = self.rng("turns", *key)
        cont, cap = float(self.p["turn_continue"]), max(int(self.p["turns"]), 1)
        n = 1
        while n < cap and rng.random() < cont:
            n += 1
        return n

    def think(self, *key: object) -> float:
        """Lognormal think time with mean ``think_time``: heavy-tailed (sigma ``think_sigma``)."""
        mean = float(self.p["think_time"])
        if mean <= 0:
            return 0.0
        sigma = float(self.p["think_sigma"])
        return self.rng("think", *key).lognormvariate(_mu(mean, sigma), sigma)

    def _arrivals(self, n: int) -> list[float]:
        rate = float(self.p["session_rate"])
        rng = self.rng("arrivals")
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(rate) if rate > 0 else 0.0
        return out

    def roots(self) -> list[RequestSpec]:
        n_apps = max(int(self.p["tenants"]), 1)
        weights = [1.0 / (k + 1) for k in range(n_apps)]
        systems = []
        for k in range(n_apps):
            rng = self.rng("system", k)
            systems.append(f"App {k}. " + self.text.text(rng, self.jitter(rng, int(self.p["prefix_len"]))))
        out = []
        times = self._arrivals(int(self.p["sessions"]))
        for s, t in enumerate(times):
            rng = self.rng("user", s, 0)
            app = rng.choices(range(n_apps), weights)[0]
            doc = self.text.text(rng, lognormal_tokens(rng, float(self.p["session_prefix_len"]), 1.0, 16000))
            question = self.text.text(rng, self._len(rng, "prompt_len"), end="?")
            ids, hist = self._first([{"role": "system", "content": systems[app]},
                                     {"role": "user", "content": doc + question}])  # fmt: skip
            out.append(
                RequestSpec(
                    rid=f"lr-s{s}-t0", prompt_ids=ids, max_tokens=self._len(rng, "output_len"),
                    session=f"lr-s{s}", turn=0, arrival_s=t,
                    meta={"session_index": s, "app": app, "turns": self._turns(s)}, state=hist,
                )
            )  # fmt: skip
        return out

    def _len(self, rng: random.Random, key: str) -> int:
        return lognormal_tokens(rng, float(self.p[key]), 0.8, 8 * int(self.p[key]))

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        s, t = spec.meta["session_index"], spec.turn + 1
        if t >= spec.meta["turns"]:
            return []
        rng = self.rng("user", s, t)
        user = self.text.text(rng, self._len(rng, "prompt_len"), lead_space=False, end="?")
        ids, hist = self._extend(spec, self._resent(spec, reply_ids), [{"role": "user", "content": user}])
        return [
            RequestSpec(
                rid=f"lr-s{s}-t{t}", prompt_ids=ids, max_tokens=self._len(rng, "output_len"),
                session=spec.session, turn=t, parent=spec.rid, delay_s=self.think(s, t),
                meta=spec.meta, state=hist,
            )
        ]  # fmt: skip


def _mu(mean: float, sigma: float) -> float:
    """The lognormal's mu for a given mean."""
    return math.log(mean) - sigma * sigma / 2


def reuse_distances(reqs: Sequence[tuple[RequestSpec, Sequence[int]]]) -> list[int]:
    """For every follow-up: how many other requests arrive between its parent and it, with
    arrivals at the roots' ``arrival_s`` plus the think times (service time left out)."""
    when: dict[str, float] = {}
    for spec, _ in reqs:  # breadth first: a parent comes before its follow-ups
        when[spec.rid] = spec.arrival_s if spec.parent is None else when[spec.parent] + spec.delay_s
    times = sorted(when.values())
    out = []
    for spec, _ in reqs:
        if spec.parent is not None:
            lo, hi = when[spec.parent], when[spec.rid]
            out.append(bisect.bisect_left(times, hi) - bisect.bisect_right(times, lo))
    return out


def describe_reuse(reqs: Sequence[tuple[RequestSpec, Sequence[int]]]) -> dict[str, float]:
    """Median and 90th percentile of ``reuse_distances`` (for reports and tests)."""
    d = sorted(reuse_distances(reqs))
    if not d:
        return {"median": 0.0, "p90": 0.0}
    return {"median": float(statistics.median(d)), "p90": float(d[int(0.9 * (len(d) - 1))])}
