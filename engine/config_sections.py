"""The engine config's sections other than ``[model]``: ``[cache]``, ``[scheduler]``,
``[kernels]``, ``[engine]``, ``[structured_outputs]``, ``[logging]``.

Each is a ``_Section`` (validated on construction and on load); every field carries its
documentation, from which docs/config.md is generated. Byte sizes (``PosBytes``,
``NonNegBytes``) take an int or a string with a unit (``"4GiB"``). Torch-free.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

from deltaserve.cache.admission import ADMISSION_POLICIES
from deltaserve.cache.manager import GDN_CHUNK_SIZE
from deltaserve.cache.remote_client import parse_url
from deltaserve.cache.types import CheckpointGranularity
from deltaserve.engine.config_base import (
    CoreProcess,
    Fraction,
    KernelBackend,
    LogLevel,
    NonNegBytes,
    NonNegInt,
    PosBytes,
    PosInt,
    _bad,
    _doc,
    _Section,
)
from deltaserve.scheduler.policy import make_policy, resolve_policy_class


class CacheConfig(_Section):
    """``[cache]``: the memory budget and how it is split; the prefix cache's behaviour.

    Split rule (``deltaserve.engine.core.sizing.plan_capacity``): the budget is
    ``memory_bytes`` (on CUDA too, when it is set), else on CUDA ``gpu_memory_utilization``
    x device memory minus the weights and the measured activation peak. Live GDN state slots come first
    (one per ``scheduler.max_num_seqs``; at most half the budget: beyond that the number
    of live slots is cut and a warning says so).

    Shared (the default for a hybrid model with prefix caching): the rest of the budget is
    one pool of pages, each holding either one GDN checkpoint or the KV blocks of the same
    bytes (``ceil(checkpoint / KV block)`` blocks), and the cache trades them as the workload
    asks; ``max_model_len`` is bounded by all pages used as KV. Fixed: setting
    ``checkpoint_fraction`` (that share of the rest to checkpoint slots, the remainder to KV
    blocks) or any explicit pool size (``num_kv_blocks`` / ``kv_cache_bytes``,
    ``checkpoint_pool_bytes``, which replace that pool's share) splits the budget once at
    start; explicit sizes that add up to more than the budget are used as given, with a
    warning. A model without GDN or without full-attention layers, or prefix caching off,
    is always fixed.
    """

    section_key: ClassVar[str] = "cache"

    block_size: Annotated[int, _doc("Tokens per KV block (the prefix-hash granularity).", ge=1, le=1024)] = 16
    memory_bytes: Annotated[
        PosBytes | None,
        _doc(
            "The cache memory budget in bytes (KV blocks + checkpoint slots + live state slots). CPU: default "
            "1 GiB. CUDA: when set, the cache takes this many bytes instead of the gpu_memory_utilization share "
            "(a ConfigError if the device has less left after the weights and activations)."
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float,
        _doc(
            "CUDA: fraction of the device's memory the engine may use in total; the cache budget is this "
            "minus the weights and the activation peak measured by a profiling forward.",
            gt=0.0,
            le=1.0,
        ),
    ] = 0.9
    checkpoint_fraction: Annotated[
        Fraction | None,
        _doc("Fixed split: the share of the budget (after live slots) given to checkpoint slots when "
             "checkpoint_pool_bytes is unset (0.2 when unset but a KV size is explicit). Unset and no "
             "explicit pool size: KV blocks and checkpoints share one pool of pages."),
    ] = None  # fmt: skip
    num_kv_blocks: Annotated[
        PosInt | None, _doc("Explicit number of KV blocks (wins over kv_cache_bytes).")
    ] = None
    kv_cache_bytes: Annotated[PosBytes | None, _doc("Explicit KV pool size in bytes.")] = None
    checkpoint_pool_bytes: Annotated[
        NonNegBytes | None, _doc("Explicit checkpoint pool size in bytes (0: no checkpoints).")
    ] = None
    enable_prefix_caching: Annotated[
        bool,
        _doc("Reuse cached prefixes (KV blocks + GDN checkpoints). Off: every prompt is computed whole."),
    ] = True
    checkpoint_staging_bytes: Annotated[
        NonNegBytes | None,
        _doc(
            "Per-step budget of checkpoint captures in bytes; captures beyond it are skipped. None: unbounded."
        ),
    ] = None
    checkpoint_interval: Annotated[
        NonNegInt,
        _doc("Also checkpoint every this many tokens (rounded up to lcm(block_size, 64)); 0 = off."),
    ] = 2048
    checkpoint_granularity: Annotated[
        CheckpointGranularity,
        _doc(
            "Where hits and tail/branch/output checkpoints may sit: block (any block boundary; a capture off "
            "the GDN kernel's 64-token chunks costs one partial chunk) | chunk (multiples of "
            "lcm(block_size, 64): free captures, a hit loses up to 63 more tokens of a turn)."
        ),
    ] = CheckpointGranularity.BLOCK
    checkpoint_policy: Annotated[
        str,
        _doc(
            "Checkpoint admission policy: default | interval | step-end | sequence-end | every-unit | none "
            "(deltaserve.cache.admission)."
        ),
    ] = "default"
    namespace: Annotated[
        str, _doc("Salt separating caches that must never share (e.g. adapters); part of every block hash.")
    ] = ""
    host_kv_cache_bytes: Annotated[
        NonNegBytes,
        _doc(
            "Host tier for KV blocks, in bytes (pinned host memory on CUDA; a separate pool on CPU): "
            "blocks the device evicts are demoted there and promoted back on a hit. 0 = off."
        ),
    ] = 0
    host_checkpoint_pool_bytes: Annotated[
        NonNegBytes,
        _doc(
            "Host tier for GDN checkpoints, in bytes: checkpoints the device evicts are demoted there "
            "(when worth more than the weakest host checkpoint); a hit restores straight from it. 0 = off."
        ),
    ] = 0
    host_memory_bytes: Annotated[
        NonNegBytes,
        _doc(
            "Host tier as one budget, in bytes: pages of one checkpoint's size, each holding one checkpoint or "
            "that many bytes of KV blocks, traded by value (instead of host_kv_cache_bytes / "
            "host_checkpoint_pool_bytes, which pin a fixed split). 0 = off."
        ),
    ] = 0
    host_load_bytes_per_step: Annotated[
        PosBytes | None,
        _doc(
            "Host -> device copies started per step, in bytes (at least one item per step); a request whose "
            "hit needs more waits for them over several steps while others run. None: unbounded."
        ),
    ] = 256 * 2**20
    disk_path: Annotated[
        str | None,
        _doc(
            "Disk tier: a directory for a persistent store of KV blocks and checkpoints (below the host "
            "tier, or the device when there is none): missing or empty (it is created), or a store made "
            "here before; a non-empty folder that is not a store is refused. A restarted engine with the "
            "same model serves hits from it; a store of another model or format is set aside. One engine "
            "per path (locked). Unset = off."
        ),
    ] = None
    disk_bytes: Annotated[
        PosBytes, _doc("Disk tier capacity in bytes; items beyond it are evicted by value per byte.")
    ] = 16 * 2**30
    disk_write_bytes_per_s: Annotated[
        PosBytes | None,
        _doc(
            "Disk tier: bytes per second written through (published checkpoints with their KV path) and "
            "back (checkpoints the tiers above evict); beyond it items are skipped. None: unbounded."
        ),
    ] = 256 * 2**20
    disk_read_buffer_bytes: Annotated[
        PosBytes,
        _doc(
            "Disk tier: host memory for hits read from disk and not yet loaded; a hit beyond it is "
            "computed instead."
        ),
    ] = 2**30
    disk_read_timeout_s: Annotated[
        float,
        _doc(
            "Disk tier: a hit not read from disk within this many seconds is given up (a miss, counted in "
            "disk.read_timeouts) and its request computes instead; a stuck read (a stalled network "
            "filesystem) holds one of the few reader threads, never a request.",
            gt=0.0,
            le=3600.0,
        ),
    ] = 5.0
    remote: Annotated[
        str | None,
        _doc(
            "Remote tier: mooncake://HOST:PORT of a Mooncake Store master (`deltaserve store`) whose store "
            "every replica shares, below the host tier: checkpoints are written through with the KV of their "
            "path and published whole; a prompt's hit is read from it when the tiers above lack it. A store "
            "that is down or slow costs hits, never a request. Unset = off."
        ),
    ] = None
    remote_segment_bytes: Annotated[
        PosBytes,
        _doc("Remote tier: memory this engine lends the store (objects live in the lenders' memory)."),
    ] = 256 * 2**20
    remote_buffer_bytes: Annotated[PosBytes, _doc("Remote tier: the Mooncake client's transfer buffer.")] = (
        64 * 2**20
    )
    remote_write_bytes_per_s: Annotated[
        PosBytes | None,
        _doc(
            "Remote tier: bytes per second written through and back; beyond it items are skipped. None: unbounded."
        ),
    ] = 256 * 2**20
    remote_timeout_s: Annotated[
        float,
        _doc(
            "Remote tier: a store call not answered within this many seconds fails (a remote hit not read by "
            "then is given up: its request computes); repeated failures pause the tier with a growing backoff.",
            gt=0.0,
            le=600.0,
        ),
    ] = 2.0

    @property
    def fixed_split(self) -> bool:
        """True when the config asks for a fixed split of the budget (a fraction or a pool size)."""
        return (
            self.checkpoint_fraction is not None
            or self.num_kv_blocks is not None
            or self.kv_cache_bytes is not None
            or self.checkpoint_pool_bytes is not None
        )

    def check(self) -> None:
        if self.checkpoint_policy not in ADMISSION_POLICIES:
            known = ", ".join(sorted(ADMISSION_POLICIES))
            raise _bad("cache.checkpoint_policy", self.checkpoint_policy, f"unknown; known: {known}")
        if self.host_memory_bytes and (self.host_kv_cache_bytes or self.host_checkpoint_pool_bytes):
            raise _bad(
                "cache.host_memory_bytes",
                self.host_memory_bytes,
                "one host budget or the fixed pair (host_kv_cache_bytes / host_checkpoint_pool_bytes), not both",
            )
        if self.disk_path is not None and not self.disk_path.strip():
            raise _bad("cache.disk_path", self.disk_path, "an empty path; unset it to turn the disk tier off")
        if self.disk_path is not None and not self.enable_prefix_caching:
            raise _bad("cache.disk_path", self.disk_path, "the disk tier needs enable_prefix_caching")
        if self.remote is not None:
            try:
                parse_url(self.remote)
            except ValueError as e:
                raise _bad("cache.remote", self.remote, str(e)) from None
            if not self.enable_prefix_caching:
                raise _bad("cache.remote", self.remote, "the remote tier needs enable_prefix_caching")


class SchedulerConfig(_Section):
    """``[scheduler]``: continuous batching limits and the scheduling policy."""

    section_key: ClassVar[str] = "scheduler"

    policy: Annotated[
        str,
        _doc("Scheduling policy: fcfs | priority | lpm | sjf, or `package.module:ClassName` of your own."),
    ] = "fcfs"
    policy_options: Annotated[
        dict[str, Any], _doc("Keyword arguments of the policy, e.g. `{aging_steps = 64}` for priority.")
    ] = {}
    max_num_seqs: Annotated[
        int, _doc("Most requests running at once (each holds one live GDN state slot).", ge=1, le=65536)
    ] = 64
    max_num_batched_tokens: Annotated[
        int,
        _doc(
            "Token budget of one step (decodes + prefill chunks); >= the checkpoint unit.", ge=GDN_CHUNK_SIZE
        ),
    ] = 2048
    max_num_partial_prefills: Annotated[int, _doc("Prompts left partially prefilled at once.", ge=1)] = 4
    enable_chunked_prefill: Annotated[
        bool,
        _doc("Split long prompts into chunks across steps; off: each prompt is prefilled whole in one step."),
    ] = True
    long_prefill_token_threshold: Annotated[
        NonNegInt,
        _doc(">0: at most this many prompt tokens per request per step, so prompts prefill side by side."),
    ] = 0
    shared_prefix_wait_tokens: Annotated[
        NonNegInt,
        _doc(
            "A waiting prompt that shares at least this many tokens past its cache hit with a prompt being "
            "computed now is admitted once that one has published them (and a checkpoint where the two part), "
            "instead of computing them beside it: a burst of requests on one new system prompt computes it "
            "once. 0 = off."
        ),
    ] = 128
    burst_window_ms: Annotated[
        float,
        _doc(
            "When the engine is idle and a prompt arrives that computes at least shared_prefix_wait_tokens past "
            "its cache hit, its first step waits up to this long (and at most 2% of the step's predicted time) "
            "for more arrivals: a burst of clients on one new system prompt is then admitted together, and the "
            "later ones resume from the first one's checkpoint where they part instead of computing the shared "
            "prefix again after it. 0 = off.",
            ge=0.0,
            le=1000.0,
        ),
    ] = 20.0
    reserve_prompt_kv: Annotated[
        bool,
        _doc(
            "Admit a prompt only while all of it fits in the device KV beside what the running prompts "
            "still need to end (vLLM admits whole prompts; SGLang reserves): prompts admitted side by "
            "side then never outgrow the device and preempt each other half built. Off: admission "
            "takes the first chunk's blocks only."
        ),
    ] = True
    max_waiting: Annotated[
        int, _doc("Most waiting requests; beyond, generate raises EngineOverloadedError.", ge=1)
    ] = 4096
    decode_step_factor: Annotated[
        float,
        _doc(
            "A step that carries decodes takes at most this many times the measured decode-only step "
            "time: its prefill gets what fits in the rest (at least one checkpoint unit). Bounds the "
            "inter-token latency while long prompts prefill; 0 = off (the full token budget). "
            'Measured in docs/architecture.md ("Inter-token latency under prefill").',
            ge=0.0,
            le=1000.0,
        ),
    ] = 3.0
    max_decode_step_ms: Annotated[
        float,
        _doc(
            ">0: a fixed target time (ms) of a step that carries decodes, instead of decode_step_factor.",
            ge=0.0,
        ),
    ] = 0.0

    def check(self) -> None:
        if 0.0 < self.decode_step_factor <= 1.0:
            raise _bad(
                "scheduler.decode_step_factor",
                self.decode_step_factor,
                "must be > 1 (a step with decodes takes the decodes' time and some prefill), or 0 = off",
            )
        try:
            resolve_policy_class(self.policy)
        except (ValueError, ImportError, AttributeError, TypeError) as e:
            raise _bad("scheduler.policy", self.policy, str(e)) from None
        try:
            make_policy(self.policy, self.policy_options)
        except Exception as e:  # a user's policy may raise anything from its constructor
            raise _bad("scheduler.policy_options", self.policy_options, f"{type(e).__name__}: {e}") from None


class KernelsConfig(_Section):
    """``[kernels]``: which kernel implementation runs."""

    section_key: ClassVar[str] = "kernels"

    backend: Annotated[
        KernelBackend,
        _doc(
            "auto (Triton on CUDA, reference on CPU) | reference | triton (CUDA, or the CPU under TRITON_INTERPRET=1)."
        ),
    ] = KernelBackend.AUTO


class EngineLoopConfig(_Section):
    """``[engine]``: how the engine loop runs its steps."""

    section_key: ClassVar[str] = "engine"

    cpu_threads: Annotated[
        NonNegInt,
        _doc(
            "On the CPU: torch's intra-op threads for the model (process-wide). 0 = OMP_NUM_THREADS when set, "
            "else every CPU this process may run on (decode and prefill both scale with threads on a dedicated "
            "machine), or 1 for a model under 256 MiB of weights (ops too small to split). On a machine "
            "shared with other busy processes use fewer: a forward that waits for a descheduled thread costs "
            "more than one thread fewer (2x on a 2-core box with one busy process). "
            "Ignored on CUDA."
        ),
    ] = 0

    async_scheduling: Annotated[
        bool,
        _doc(
            "Overlap the host work with the model: schedule and prepare step N+1, and process step N's "
            "outputs, while step N's forward runs on a worker thread (its sampled tokens reach step N+1 on "
            "the device). Same outputs as off; pays on a GPU, may not on a CPU. With speculative decoding a "
            "step that verifies drafts (or that precedes one) is not overlapped. See docs/architecture.md."
        ),
    ] = False
    core_process: Annotated[
        CoreProcess,
        _doc(
            "Where the engine core runs: in_process (a step thread beside the front end) | separate (its "
            "own process: scheduler, cache, model and sampling there; tokenizing, detokenizing, stop "
            "strings and HTTP in the front end's; docs/server.md) | auto (`deltaserve serve`: separate; "
            "an application's `AsyncEngine(config)`: in_process, as embedding the engine expects). "
            "`--in-process` sets in_process."
        ),
    ] = CoreProcess.AUTO
    release_memory: Annotated[
        bool,
        _doc(
            "Give freed host memory back to the OS (glibc `malloc_trim`) each time the engine goes idle, so "
            "resident memory returns to weights + cache pools + overhead between bursts instead of keeping "
            "the largest step's activation temporaries. No effect off glibc. See docs/architecture.md (Host memory)."
        ),
    ] = True


class StructuredOutputsConfig(_Section):
    """``[structured_outputs]``: how output constraints (JSON schemas, regexes, grammars) compile."""

    section_key: ClassVar[str] = "structured_outputs"

    compile_timeout_s: Annotated[
        float,
        _doc(
            "The longest a request waits for its output constraint to compile against the vocabulary; "
            "past it the request is refused (GrammarTimeoutError, HTTP 400) while the compile finishes in "
            "the background and is cached for the next request. Compiles never run on a loop that serves "
            "other requests.",
            gt=0.0,
            le=3600.0,
        ),
    ] = 10.0
    compile_threads: Annotated[
        int,
        _doc(
            "Worker threads compiling constraints in the engine core: a slow compile holds one, the others "
            "go on serving new schemas.",
            ge=1,
            le=16,
        ),
    ] = 2


class LoggingConfig(_Section):
    """``[logging]``: what the engine logs. The application configures where logs go."""

    section_key: ClassVar[str] = "logging"

    level: Annotated[
        LogLevel,
        _doc(
            "Level of the `deltaserve` logger (stdlib logging); the application's handlers decide where it goes."
        ),
    ] = LogLevel.INFO
    stats_interval_s: Annotated[
        float, _doc("Seconds between periodic `engine.stats` log lines; 0 = none.", ge=0.0, le=86400.0)
    ] = 5.0

    def check(self) -> None:
        if not math.isfinite(self.stats_interval_s):
            raise _bad("logging.stats_interval_s", self.stats_interval_s, "must be a finite number >= 0")
