"""One scheduler step as the engine takes it, for the scheduler tests: schedule, sample token 7
on every row that samples, finish each request that reached its ``max_tokens``. Torch-free."""

from __future__ import annotations

from deltaserve.scheduler import Scheduler, SchedulerOutput


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    assert out is not None, "stuck with waiting requests"
    s.update(out, [7 if x.samples else None for x in out.seqs])
    for x in out.seqs:
        r = x.request
        if x.samples and r.num_output_tokens >= r.sampling_params.max_tokens:
            s.finish(r, "length")
    return out
