"""The ``trace`` workload: replay a JSONL file (ours or a Mooncake trace) at its own arrival times."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from deltaserve.tools.workloads.codecs import Codec
from deltaserve.tools.workloads.request import RequestSpec
from deltaserve.tools.workloads.workload import Workload, WorkloadParams

#: tokens per ``hash_ids`` entry of a Mooncake trace
MOONCAKE_BLOCK_TOKENS = 512


class TraceWorkload(Workload):
    """Replay a JSONL trace. Two row formats:

    * ours: ``{arrival_s, prompt | prompt_token_ids | messages, max_tokens}`` (optional
      ``request_id``, ``session``, ``turn``);
    * Mooncake's (FAST'25 traces): ``{timestamp (ms), input_length, output_length,
      hash_ids}``, where each hash id names one 512-token block and equal ids mean equal
      prefixes. The tokens of a hash id are synthesized deterministically (a generator
      seeded by the id), so requests sharing leading hash ids share exactly that prefix;
      the prompt is the blocks' tokens cut to ``input_length``.
    """

    name = "trace"
    defaults: dict[str, Any] = {}

    def __init__(self, params: WorkloadParams, codec: Codec) -> None:
        super().__init__(params, codec)
        self._blocks: dict[int, list[int]] = {}

    def block_tokens(self, hash_id: int) -> list[int]:
        """The 512 synthesized tokens of one Mooncake hash id (deterministic, not under ``seed``)."""
        ids = self._blocks.get(hash_id)
        if ids is None:
            below = random.Random(f"mooncake:{hash_id}")._randbelow
            width = max(self.codec.vocab_size, 1024) - 3
            # ``randrange(3, hi)`` is ``3 + _randbelow(hi - 3)``: the same tokens at half the cost
            # (a trace synthesizes millions of them)
            ids = self._blocks[hash_id] = [3 + below(width) for _ in range(MOONCAKE_BLOCK_TOKENS)]
        return ids

    def _mooncake_prompt(self, row: dict[str, Any]) -> list[int]:
        n = int(row["input_length"])
        ids: list[int] = []
        for h in row["hash_ids"]:
            ids += self.block_tokens(int(h))
        if len(ids) < n:  # a trace whose input outgrows its hash ids: fill from the request's own stream
            rng = random.Random(f"mooncake:tail:{row.get('timestamp')}:{n}")
            ids += [rng.randrange(3, max(self.codec.vocab_size, 1024)) for _ in range(n - len(ids))]
        return ids[:n]

    def roots(self) -> list[RequestSpec]:
        path = self.p.get("trace")
        if not path:
            raise ValueError("the trace workload needs --trace FILE (JSONL of {arrival_s, prompt | "
                             "prompt_token_ids | messages, max_tokens} or Mooncake's {timestamp, "
                             "input_length, output_length, hash_ids})")  # fmt: skip
        scale = float(self.p["time_scale"])
        out = []
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: {e}") from None
            arrival = float(row.get("arrival_s", 0.0))
            max_tokens = int(row.get("max_tokens", self.p["output_len"]))
            if "hash_ids" in row:
                try:
                    ids = self._mooncake_prompt(row)
                    arrival = float(row.get("timestamp", 0.0)) / 1000.0
                    max_tokens = max(int(row.get("output_length", max_tokens)), 1)
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{i + 1}: bad Mooncake row ({e})") from None
            elif "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
            elif "messages" in row:
                ids = self.codec.encode(self.render(row["messages"]))
            elif "prompt" in row:
                ids = self.codec.encode(str(row["prompt"]))
            else:
                raise ValueError(f"{path}:{i + 1}: needs prompt, prompt_token_ids, messages or hash_ids")
            out.append(
                RequestSpec(
                    rid=str(row.get("request_id", f"trace-{i}")), prompt_ids=ids, max_tokens=max_tokens,
                    session=str(row.get("session", f"trace-{i}")), turn=int(row.get("turn", 0)),
                    arrival_s=arrival * scale, meta={"line": i + 1},
                )
            )  # fmt: skip
        out.sort(key=lambda r: r.arrival_s or 0.0)
        return out
