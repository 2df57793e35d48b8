"""The replay drafter (``speculative.method = "replay"``): proposes the output an earlier
greedy run produced for the same prompt, so with greedy sampling every draft is accepted —
the mechanism's ceiling, whatever the model (random weights give a real drafter nothing to
predict). For tests and benchmarks.

It learns in the engine: every greedy request that ends with its output (stop or length)
records ``prompt -> delivered output`` (``finished``; the latest run of a prompt wins), and
``record`` seeds it directly. A request proposes from its prompt's recording while its own
output agrees with it so far (a run that diverged, or a sampled one, gets no drafts).

``replay_corrupt_every = N`` makes the draft for every output position ``p`` with
``(p + 1) % N == 0`` wrong (the token id after it, modulo the vocabulary): with ``N = 2`` a
window of ``k >= 2`` drafts accepts one and emits two tokens.
"""

from __future__ import annotations

from deltaserve.engine.config_spec import SpecMethod
from deltaserve.engine.sampling_params import GREEDY_TEMPERATURE
from deltaserve.engine.spec.drafter import register_drafter
from deltaserve.scheduler.request import Request


class ReplayDrafter:
    """See the module docstring."""

    def __init__(self, vocab_size: int, corrupt_every: int = 0) -> None:
        self.vocab_size = vocab_size
        self.corrupt_every = corrupt_every
        self.recorded: dict[tuple[int, ...], list[int]] = {}

    def record(self, prompt: list[int], output: list[int]) -> None:
        """Replay ``output`` to every later request of ``prompt``."""
        self.recorded[tuple(prompt)] = list(output)

    def propose(self, request: Request, k: int) -> list[int]:
        # (looked up each step: hashing a prompt costs microseconds, and nothing is kept per request)
        out = self.recorded.get(tuple(request.prompt_token_ids))
        n_out = request.num_output_tokens
        # (the output so far agrees with the recording: checked at its last token, each step)
        if out is None or n_out == 0 or n_out >= len(out) or out[n_out - 1] != request.token_ids[-1]:
            return []
        drafts = out[n_out : n_out + k]
        every = self.corrupt_every
        if every:
            drafts = [
                (t + 1) % self.vocab_size if (n_out + i + 1) % every == 0 else t for i, t in enumerate(drafts)
            ]
        return drafts

    def finished(self, request: Request, num_output: int) -> None:
        if request.sampling_params.temperature < GREEDY_TEMPERATURE and num_output > 0:
            self.record(request.prompt_token_ids, request.output_token_ids[:num_output])


register_drafter(SpecMethod.REPLAY, lambda cfg, vocab: ReplayDrafter(vocab, cfg.replay_corrupt_every))
