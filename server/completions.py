"""``/v1/completions`` responses: the whole response, and the chunks of a stream. A batch of
prompts gives ``n`` choices per prompt, indexed ``prompt * n + completion``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec

from deltaserve.engine.outputs import RequestOutput, TokenLogprob
from deltaserve.server import protocol as p
from deltaserve.server.errors import engine_failure
from deltaserve.server.sse import data_frame, error_frame
from deltaserve.server.tracker import Choice, Tracker, usage

TokenText = Callable[[int], str]


def completion_logprobs(
    token_text: TokenText, entries: list[TokenLogprob], offset: int = 0
) -> p.CompletionLogprobs:
    """Log-probabilities in the completions API's shape; ``offset``: the text's offset so far."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        lps.append(e.logprob)
        tops.append({token_text(tid): lp for tid, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)


def completion_response(
    trackers: list[Tracker], token_text: TokenText, rid: str, model: str, n: int, return_ids: bool
) -> p.CompletionResponse:
    """The whole response once every completion of every prompt has finished."""
    choices = []
    for k, t in enumerate(trackers):
        for c in t.choices:
            c.raise_if_failed()
            choices.append(
                p.CompletionChoice(
                    index=k * n + c.index,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    logprobs=completion_logprobs(token_text, c.logprobs) if c.logprobs else None,
                    token_ids=list(c.token_ids) if return_ids else msgspec.UNSET,
                )
            )
    return p.CompletionResponse(
        id=rid, created=int(time.time()), model=model, choices=choices, usage=usage(trackers)
    )


class CompletionChunks:
    """A completion stream's ``ChunkFormat``: one chunk per output that carries something, the
    last one of each completion with its finish reason."""

    def __init__(
        self, token_text: TokenText, rid: str, model: str, n: int, num_prompts: int, *, return_ids: bool
    ) -> None:
        self.token_text = token_text
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.n, self.return_ids = n, return_ids
        self.offsets = [[0] * n for _ in range(num_prompts)]  # text offset of each completion

    def frames(self, k: int, out: RequestOutput, choice: Choice, tracker: Tracker) -> Iterator[bytes]:
        lp = None
        if out.logprobs:
            lp = completion_logprobs(self.token_text, out.logprobs, self.offsets[k][out.index])
        self.offsets[k][out.index] += len(out.text)
        if out.finished:
            tracker.count_finish(out.finish_reason)
            if out.finish_reason == "error":
                yield error_frame(engine_failure(choice.error))
        if out.text or lp is not None or out.finished or (self.return_ids and out.token_ids):
            c = p.CompletionChoice(
                index=k * self.n + out.index,
                text=out.text,
                finish_reason=out.finish_reason if out.finished else None,
                logprobs=lp,
                token_ids=list(out.token_ids) if self.return_ids else msgspec.UNSET,
            )
            yield data_frame(
                p.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[c])
            )

    def usage_frame(self, trackers: list[Tracker]) -> bytes:
        return data_frame(
            p.CompletionResponse(
                id=self.rid, created=self.created, model=self.model, choices=[], usage=usage(trackers)
            )
        )
