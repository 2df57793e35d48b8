"""The ``tenants`` workloads: many long system prompts with a volatile first line;
``tenants-shift``: the same, with the tenants' popularity shifting over time."""

from __future__ import annotations

from deltaserve.tools.workloads.chat import _UserTurns
from deltaserve.tools.workloads.request import RequestSpec


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
            k = self._tenant(rng.choices(range(n_tenants), weights)[0], s, n_tenants)
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

    def _tenant(self, rank: int, session: int, n_tenants: int) -> int:
        """The tenant at popularity ``rank`` for ``session`` (fixed here)."""
        return rank


class TenantsShiftWorkload(TenantsWorkload):
    """``tenants`` whose popularity shifts: every ``shift_every`` sessions the Zipf ranks move
    ``shift_by`` tenants along, so the most popular tenant of one phase is a rare one two phases
    later and a cache's learned favourites go stale (default: 4 phases over the run)."""

    name = "tenants-shift"
    defaults = {**TenantsWorkload.defaults, "shift_every": 32, "shift_by": 5}

    def _tenant(self, rank: int, session: int, n_tenants: int) -> int:
        phase = session // max(int(self.p["shift_every"]), 1)
        return (rank + phase * int(self.p["shift_by"])) % n_tenants
