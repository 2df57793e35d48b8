"""Independent requests (one request per session, no follow-ups): ``shared-prefix``,
``prefix-repetition``, ``shifted-prefix`` and ``random`` (no sharing: the control)."""

from __future__ import annotations

from typing import Any

from deltaserve.tools.workloads.request import RequestSpec
from deltaserve.tools.workloads.text import WORDS
from deltaserve.tools.workloads.workload import SLOT, Workload


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


class _Singles(Workload):
    def _singles(self, key: str, rid: str, prefix: list[int], meta: dict[str, Any]) -> list[RequestSpec]:
        """``num_requests`` requests ``{rid}-{i}``: ``prefix``, then a text of about ``prompt_len``
        tokens from ``rng(key, i)`` whose first word no other request's text starts with."""
        used: set[int] = set()
        out = []
        for i in range(int(self.p["num_requests"])):
            rng = self.rng(key, i)
            text = self.text.text(rng, self.jitter(rng, int(self.p["prompt_len"])), distinct_first=used)
            out.append(
                RequestSpec(
                    rid=f"{rid}-{i}", prompt_ids=prefix + self.codec.encode(text),
                    max_tokens=int(self.p["output_len"]), session=f"{rid}-{i}", meta=dict(meta),
                )
            )  # fmt: skip
        return out


class ShiftedPrefixWorkload(_Singles):
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
        return self._singles("unique", "shifted", prefix, {"prefix_tokens": len(prefix)})


class RandomWorkload(_Singles):
    name = "random"
    defaults = {"num_requests": 16, "prompt_len": 256}

    def roots(self) -> list[RequestSpec]:
        return self._singles("prompt", "random", [], {})
