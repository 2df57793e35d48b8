"""EngineCore: the synchronous engine — input validation, one step, output processing.

``AsyncEngine`` drives it from an asyncio loop (the step runs in an executor thread);
tests drive it directly and call ``check_integrity()`` after every step. It is not
thread-safe: its owner calls ``add_request``/``abort_request`` only between steps.

Nothing is lost: every admitted request ends with exactly one finished ``RequestOutput``
(``stop``, ``length``, ``abort`` or ``error`` with a message), and every block and slot
returns to its pool.
"""

from __future__ import annotations

import copy
import itertools
import time
import uuid
from collections.abc import Sequence
from typing import Any

import structlog
import torch

from deltaserve.cache.hashing import make_salt
from deltaserve.cache.manager import CacheManager, CacheManagerConfig
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.errors import (
    ConfigError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
)
from deltaserve.engine.model_runner import ModelRunner, RunnerSizes
from deltaserve.engine.outputs import RequestOutput
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.kernels import get_ops
from deltaserve.models import LoadedModel, load_model
from deltaserve.scheduler.policy import make_policy
from deltaserve.scheduler.request import Request
from deltaserve.scheduler.scheduler import Scheduler

log = structlog.get_logger("deltaserve.engine")

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = torch.device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.ops = get_ops(config.kernels.backend, self.device)
        torch.manual_seed(config.model.seed)
        self.loaded = loaded or load_model(
            config.model.path, dtype=self.dtype, device=self.device, ops=self.ops
        )
        self.tokenizer = self.loaded.tokenizer
        # Detokenization runs in the step thread while `generate` tokenizes on the event-loop
        # thread; HF fast tokenizers mutate themselves while encoding ("Already borrowed"), so
        # each thread gets its own instance.
        self.detok_tokenizer = copy.deepcopy(self.tokenizer)
        spec = self.loaded.model.cache_spec()
        self.spec = spec
        cc, sc = config.cache, config.scheduler
        self.max_model_len = config.model.max_model_len or self.loaded.max_position_embeddings
        if spec.num_attn_layers:
            num_blocks = cc.num_kv_blocks or max(cc.kv_cache_bytes // spec.kv_block_bytes(cc.block_size), 1)
        else:
            num_blocks = cc.num_kv_blocks or 1 << 20  # a pure-GDN model: blocks are bookkeeping only
        has_gdn = spec.num_gdn_layers > 0
        ckpt_bytes = spec.state_slot_bytes() if has_gdn else 0
        num_ckpt = cc.checkpoint_pool_bytes // ckpt_bytes if has_gdn else 0
        if not cc.enable_prefix_caching:
            num_ckpt = 0
        self.cache = CacheManager(
            CacheManagerConfig(
                block_size=cc.block_size,
                num_kv_blocks=num_blocks,
                num_live_slots=sc.max_num_seqs if has_gdn else 0,
                num_checkpoint_slots=num_ckpt,
                checkpoint_bytes=ckpt_bytes,
                staging_bytes=cc.checkpoint_staging_bytes,
                has_gdn=has_gdn,
                checkpoint_interval=cc.checkpoint_interval,
                checkpoint_policy=cc.checkpoint_policy,
                enable_prefix_caching=cc.enable_prefix_caching,
            )
        )
        if sc.max_num_batched_tokens < self.cache.unit:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens = {sc.max_num_batched_tokens}: must be >= the checkpoint "
                f"unit lcm(block_size, 64) = {self.cache.unit}"
            )
        self.scheduler = Scheduler(
            self.cache,
            make_policy(sc.policy, sc.policy_options),
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_num_partial_prefills=sc.max_num_partial_prefills,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            long_prefill_token_threshold=sc.long_prefill_token_threshold,
        )
        self.runner = ModelRunner(
            self.loaded,
            self.ops,
            RunnerSizes(
                num_blocks if spec.num_attn_layers else 1, cc.block_size, self.cache.slots.num_live, num_ckpt
            ),
            self.device,
        )
        self.runner.default_generator.manual_seed(config.model.seed)
        self._salt_parts = (str(self.loaded.path), config.model.dtype, cc.namespace)
        self.eos_token_ids = set(self.loaded.eos_token_ids)
        self.vocab_size = int(self.loaded.hf_config.vocab_size)
        self._ids = itertools.count()
        self.counters = {
            "requests.finished": 0,
            "requests.aborted": 0,
            "requests.failed": 0,
            "tokens.prompt": 0,
            "tokens.generated": 0,
            "tokens.computed": 0,
            "steps.failed": 0,
        }
        log.info(
            "engine.ready",
            model=str(self.loaded.path),
            model_type=self.loaded.model_type,
            dtype=str(self.dtype),
            device=str(self.device),
            kernels=self.ops.name,
            kv_blocks=num_blocks,
            block_size=cc.block_size,
            checkpoint_slots=num_ckpt,
            checkpoint_mib=round(num_ckpt * ckpt_bytes / 2**20, 2),
            live_slots=self.cache.slots.num_live,
            max_model_len=self.max_model_len,
        )

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a str, a list of token ids, or chat messages; typed errors."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(
                f"prompt must be a str, a list of token ids or a list of chat messages, got {type(prompt).__name__}"
            )
        if len(prompt) == 0:
            raise InvalidRequestError("prompt is empty")
        if all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidRequestError(f"message {i} must have string 'role' and 'content', got {m!r}")
            try:
                text = self.tokenizer.apply_chat_template(
                    list(prompt), tokenize=False, add_generation_prompt=True
                )
            except Exception as e:  # no template, or the template rejects these messages
                raise InvalidRequestError(f"chat template could not render the messages: {e}") from e
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids = list(prompt)
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise InvalidRequestError(f"prompt token {i} is {t!r}, not an int")
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token {i} = {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        return ids

    def make_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and build a request (raises InvalidRequestError / PromptTooLongError)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an int, got {priority!r}")
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"stop token id {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} (room for at least one "
                f"generated token is needed)"
            )
        need = min(len(ids) + params.max_tokens, self.max_model_len)
        if not self.cache.can_ever_fit(need):
            raise PromptTooLongError(
                f"request needs {need} tokens of KV cache but the whole pool holds "
                f"{self.cache.blocks.num_blocks * self.cache.block_size}"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {rid!r}")
        if rid in self.scheduler.requests:
            raise InvalidRequestError(f"request_id {rid!r} is already in use")
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=params,
            priority=priority,
            cache_salt=make_salt(*self._salt_parts, cache_salt),
        )
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            req.extra["generator"] = gen
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        req.extra["stop_ids"] = stop_ids
        req.extra["detok"] = IncrementalDetokenizer(self.detok_tokenizer, params.stop)
        return req

    def check_capacity(self, pending: int = 0) -> None:
        """Admission control: raise EngineOverloadedError when the waiting queue is full."""
        waiting = self.scheduler.num_waiting + pending
        if waiting >= self.config.scheduler.max_waiting:
            raise EngineOverloadedError(
                f"waiting queue is full ({waiting} >= scheduler.max_waiting = "
                f"{self.config.scheduler.max_waiting}); retry later"
            )

    def add_request(self, req: Request) -> None:
        self.check_capacity()
        self.scheduler.add(req)
        self.counters["tokens.prompt"] += req.num_prompt_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        self.counters["requests.aborted"] += 1
        return self._final_output(req, "abort", [], "")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, apply results; the outputs produced by this step."""
        out = self.scheduler.schedule()
        if out is None:
            return []
        try:
            sampled = self.runner.execute(out)
        except Exception as e:  # one failed step ends only its own requests
            self.counters["steps.failed"] += 1
            log.error("step.failed", error=repr(e), requests=[s.request.request_id for s in out.seqs])
            failed = self.scheduler.fail_step(out)
            self.counters["requests.failed"] += len(failed)
            msg = f"model step failed: {type(e).__name__}: {e}"
            return [self._final_output(r, "error", [], "", error=msg) for r in failed]
        self.scheduler.update(out, sampled)
        self.counters["tokens.computed"] += out.num_tokens
        outputs: list[RequestOutput] = []
        for s, token in zip(out.seqs, sampled, strict=True):
            if token is not None:
                outputs.append(self._process_token(s.request, token))
        return outputs

    def _process_token(self, req: Request, token: int) -> RequestOutput:
        params: SamplingParams = req.sampling_params
        self.counters["tokens.generated"] += 1
        detok: IncrementalDetokenizer = req.extra["detok"]
        text = detok.add([token])
        n_out = req.num_output_tokens
        reason: str | None = None
        if n_out >= params.min_tokens and (token in req.extra["stop_ids"] or detok.stopped):
            reason = "stop"
        if reason is None and (n_out >= params.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is None:
            return RequestOutput(
                request_id=req.request_id,
                token_ids=[token],
                text=text,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=max(req.num_cached_tokens, 0),
            )
        text += detok.flush()
        self.scheduler.finish(req, reason)
        self.counters["requests.finished"] += 1
        return self._final_output(req, reason, [token], text)

    def _final_output(
        self, req: Request, reason: str, token_ids: list[int], text: str, error: str | None = None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            text=text,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=error,
        )

    # ------------------------------------------------------------------ introspection
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out.update(self.scheduler.stats())
        out.update(self.cache.stats())
        out["time"] = time.time()
        return out

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request still queued or running (engine exit); their final outputs."""
        outs = [self.abort_request(rid) for rid in list(self.scheduler.requests)]
        return [o for o in outs if o is not None]
