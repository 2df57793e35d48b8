"""Independent requests (one request per session, no follow-ups): ``shared-prefix``,
``prefix-repetition``, ``shifted-prefix`` and ``random`` (no sharing: the control)."""

from __future__ import annotations

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
