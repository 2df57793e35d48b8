"""EngineConfig: typed msgspec structs in sections, validated on load *and* on construction.

``EngineConfig.load(path, overrides={"scheduler.policy": "lpm"})`` reads TOML, JSON or
YAML (by extension), applies dotted overrides, and converts strictly: an unknown key, a
wrong type or an out-of-range value raises ``ConfigError`` naming the key and the value.
Building the structs in code (``CacheConfig(block_size=0)``) runs the same checks, so no
invalid config can reach the engine. Every tool accepts ``--config FILE`` and
``--set section.key=value`` (see ``deltaserve.engine.cli``).

Every field carries its documentation (``msgspec.Meta(description=...)``);
``docs/config.md`` is generated from it (``python tools/gen_config_docs.py``) and a test
fails when the two disagree.

This module never imports torch (the cache simulator loads it).
"""

from __future__ import annotations

import enum
import functools
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any

import msgspec
import tomllib

from deltaserve.cache.admission import ADMISSION_POLICIES
from deltaserve.cache.manager import GDN_CHUNK_SIZE
from deltaserve.cache.types import CheckpointGranularity
from deltaserve.engine.errors import ConfigError
from deltaserve.scheduler.policy import make_policy, resolve_policy_class

MiB = 1024**2
GiB = 1024**3


def _doc(text: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **constraints)


class DType(str, enum.Enum):
    """Model weights and KV-cache dtype (the recurrent GDN state is always float32)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    AUTO = "auto"  # bfloat16 on CUDA, float32 on the CPU


class KernelBackend(str, enum.Enum):
    """Which implementation of the kernel ops runs (``deltaserve.kernels.get_ops``)."""

    AUTO = "auto"  # Triton on CUDA, the PyTorch reference on the CPU
    REFERENCE = "reference"
    TRITON = "triton"


class CoreProcess(str, enum.Enum):
    """Where ``deltaserve serve`` runs the engine core (``engine.core_process``)."""

    IN_PROCESS = "in_process"  # AsyncEngine: the step thread shares the server's process (and GIL)
    SEPARATE = "separate"  # EngineProcClient: the core in a process of its own (engine/core_proc.py)


class LogLevel(str, enum.Enum):
    """Level of the ``deltaserve`` logger (stdlib ``logging`` levels)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A config section: its fields are checked against their declared types and
    constraints when it is built in code too (msgspec checks them only when decoding)."""

    def __post_init__(self) -> None:
        for f in msgspec.structs.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, msgspec.Struct):
                continue  # a nested section validated itself when it was built
            try:
                msgspec.convert(value, f.type, strict=True)
            except msgspec.ValidationError as e:
                reason = re.sub(r" - at `\$[^`]*`", "", str(e))
                key = f"{_section_name(type(self))}.{f.name}"
                raise ConfigError(f"{key} = {value!r}: {_enum_hint(reason, f.type)}") from None
        self.check()

    def check(self) -> None:
        """Cross-field rules of the section; raise ``ConfigError``."""


def _section_name(cls: type) -> str:
    return next((name for name, c in _sections().items() if c is cls), cls.__name__)


def _bad(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{key} = {value!r}: {why}")


PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)]


class ModelConfig(_Section):
    """``[model]``: which model runs, where, in which dtype."""

    path: Annotated[
        str,
        _doc(
            "The model: `builtin:tiny-qwen3.5` (default), `builtin:tiny-qwen3-next`, `builtin:tiny-qwen3`, "
            "or a local Hugging Face-format folder (config.json + safetensors + tokenizer files).",
            min_length=1,
        ),
    ] = "builtin:tiny-qwen3.5"
    tokenizer: Annotated[
        str | None,
        _doc(
            "The tokenizer (and chat template), when not the model's own: a local Hugging Face-format "
            "folder or `builtin:<name>`. Unset: the model folder's."
        ),
    ] = None
    dtype: Annotated[
        DType,
        _doc(
            "Weights and KV-cache dtype: float32, bfloat16, float16, or auto (bfloat16 on CUDA, float32 on CPU)."
        ),
    ] = DType.AUTO
    device: Annotated[
        str,
        _doc(
            "auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N. A CUDA device "
            "that is not there is a ConfigError at engine start; `engine.ready` logs the choice."
        ),
    ] = "auto"
    max_model_len: Annotated[
        PosInt | None,
        _doc(
            "Longest sequence (prompt + output) a request may reach. Default: the smaller of the model's "
            "maximum and what the KV pool can hold for one request; an explicit value the pool cannot "
            "hold is a ConfigError naming both numbers."
        ),
    ] = None
    seed: Annotated[
        int, _doc("Seed of the random generator used by requests without their own seed.", ge=0, le=2**63 - 1)
    ] = 0
    generation_config: Annotated[
        str,
        _doc(
            "Where requests' sampling defaults come from (vLLM's --generation-config): `auto`, the "
            "model folder's generation_config.json (its temperature, top_p, top_k, min_p and "
            "repetition_penalty fill the fields a request leaves unset); `vllm`, none (the built-in "
            "neutral defaults); or a folder holding a generation_config.json. `engine.sampling_defaults` "
            "logs the values in use at start.",
            min_length=1,
        ),
    ] = "auto"
    chat_template: Annotated[
        str | None,
        _doc(
            "A Jinja chat template file whose contents replace the tokenizer's template (vLLM's "
            "--chat-template). Unset: the tokenizer's own. A request's own `chat_template` still wins."
        ),
    ] = None

    def check(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise _bad("model.device", self.device, "expected auto, cpu, cuda or cuda:N")


class CacheConfig(_Section):
    """``[cache]``: the memory budget and how it is split; the prefix cache's behaviour.

    Split rule (``deltaserve.engine.sizing.plan_capacity``): the budget is
    ``memory_bytes`` on the CPU, or ``gpu_memory_utilization`` x device memory minus the
    weights and the measured activation peak on CUDA. Live GDN state slots come first
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

    block_size: Annotated[int, _doc("Tokens per KV block (the prefix-hash granularity).", ge=1, le=1024)] = 16
    memory_bytes: Annotated[
        PosInt | None,
        _doc(
            "CPU: the cache memory budget in bytes (KV blocks + checkpoint slots + live state slots). "
            "Default 1 GiB. Ignored on CUDA (see gpu_memory_utilization)."
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
    kv_cache_bytes: Annotated[PosInt | None, _doc("Explicit KV pool size in bytes.")] = None
    checkpoint_pool_bytes: Annotated[
        NonNegInt | None, _doc("Explicit checkpoint pool size in bytes (0: no checkpoints).")
    ] = None
    enable_prefix_caching: Annotated[
        bool,
        _doc("Reuse cached prefixes (KV blocks + GDN checkpoints). Off: every prompt is computed whole."),
    ] = True
    checkpoint_staging_bytes: Annotated[
        NonNegInt | None,
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
        NonNegInt,
        _doc(
            "Host tier for KV blocks, in bytes (pinned host memory on CUDA; a separate pool on CPU): "
            "blocks the device evicts are demoted there and promoted back on a hit. 0 = off."
        ),
    ] = 0
    host_checkpoint_pool_bytes: Annotated[
        NonNegInt,
        _doc(
            "Host tier for GDN checkpoints, in bytes: checkpoints the device evicts are demoted there "
            "(when worth more than the weakest host checkpoint); a hit restores straight from it. 0 = off."
        ),
    ] = 0
    host_memory_bytes: Annotated[
        NonNegInt,
        _doc(
            "Host tier as one budget, in bytes: pages of one checkpoint's size, each holding one checkpoint or "
            "that many bytes of KV blocks, traded by value (instead of host_kv_cache_bytes / "
            "host_checkpoint_pool_bytes, which pin a fixed split). 0 = off."
        ),
    ] = 0
    host_load_bytes_per_step: Annotated[
        PosInt | None,
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
        PosInt, _doc("Disk tier capacity in bytes; items beyond it are evicted by value per byte.")
    ] = 16 * 2**30
    disk_write_bytes_per_s: Annotated[
        PosInt | None,
        _doc(
            "Disk tier: bytes per second written through (published checkpoints with their KV path) and "
            "back (checkpoints the tiers above evict); beyond it items are skipped. None: unbounded."
        ),
    ] = 256 * 2**20
    disk_read_buffer_bytes: Annotated[
        PosInt,
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


class SchedulerConfig(_Section):
    """``[scheduler]``: continuous batching limits and the scheduling policy."""

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

    backend: Annotated[
        KernelBackend,
        _doc(
            "auto (Triton on CUDA, reference on CPU) | reference | triton (CUDA, or the CPU under TRITON_INTERPRET=1)."
        ),
    ] = KernelBackend.AUTO


class EngineLoopConfig(_Section):
    """``[engine]``: how the engine loop runs its steps."""

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
            "the device). Same outputs as off; pays on a GPU, may not on a CPU. See docs/architecture.md."
        ),
    ] = False
    core_process: Annotated[
        CoreProcess,
        _doc(
            "Where `deltaserve serve` runs the engine core: in_process (AsyncEngine, the step thread beside "
            "the HTTP front end) | separate (its own process: scheduler, cache, model and sampling there; "
            "tokenizing, detokenizing, stop strings and HTTP in the server's; docs/server.md). "
            "`--in-process` sets in_process. An application picks by constructing AsyncEngine or "
            "EngineProcClient."
        ),
    ] = CoreProcess.SEPARATE
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


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole engine configuration: ``[model]``, ``[cache]``, ``[scheduler]``, ``[kernels]``,
    ``[engine]``, ``[structured_outputs]``, ``[logging]`` (every key: docs/config.md).

    Build it with ``EngineConfig.load(path, overrides)`` (TOML/JSON/YAML), ``from_dict``, or
    in code (``EngineConfig(cache=CacheConfig(block_size=32))``); all three validate and
    raise ``ConfigError`` naming the key and the value. ``replace(**{"a.b": v})`` returns a
    validated copy.
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    kernels: KernelsConfig = msgspec.field(default_factory=KernelsConfig)
    engine: EngineLoopConfig = msgspec.field(default_factory=EngineLoopConfig)
    structured_outputs: StructuredOutputsConfig = msgspec.field(default_factory=StructuredOutputsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        for name, cls in _sections().items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(
                    f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}"
                )
        self.validate()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> EngineConfig:
        """Read ``path`` (TOML, JSON or YAML; None: defaults) and apply dotted ``overrides``."""
        data: dict[str, Any] = read_config_file(path) if path is not None else {}
        for key, value in (overrides or {}).items():
            set_dotted(data, key, value)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Convert nested plain data (as read from a file) strictly; ``ConfigError`` if invalid."""
        try:
            return msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ConfigError(_explain(str(e), data)) from None

    def to_dict(self) -> dict[str, Any]:
        """Nested plain data (enums as their values), the inverse of ``from_dict``."""
        return msgspec.to_builtins(self)

    def replace(self, **dotted: Any) -> EngineConfig:
        """A copy with dotted keys replaced: ``cfg.replace(**{"scheduler.policy": "lpm"})``."""
        data = self.to_dict()
        for key, value in dotted.items():
            set_dotted(data, key, value)
        return EngineConfig.from_dict(data)

    def validate(self) -> None:
        """Rules across sections; raise ``ConfigError``."""
        # (the checkpoint unit lcm(block_size, 64) may exceed the token budget: checked by
        # the engine, which knows whether the model has GDN layers at all)


# ---------------------------------------------------------------------- helpers
def read_config_file(path: str | Path) -> dict[str, Any]:
    """The top-level table of a TOML, JSON or YAML file; ``ConfigError`` if unreadable."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".json", ".yaml", ".yml"):
        raise ConfigError(f"{p}: unknown config format {suffix!r} (use .toml, .json, .yaml)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ConfigError(f"{p}: {e}") from None
    except Exception as e:  # yaml's own error types
        raise ConfigError(f"{p}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a table/object")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data["a"]["b"] = value`` for ``key = "a.b"``, creating sections as needed."""
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override key {key!r} must be section.key")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``section.key=value``; the value is read as a TOML literal, else a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if raw.lower() in ("none", "null"):
        value = None
    return key, value


def _enum_hint(reason: str, typ: Any) -> str:
    """msgspec says 'Invalid enum value'; say which values are allowed."""
    if "Invalid enum value" in reason:
        base = getattr(typ, "__origin__", typ)
        args = getattr(typ, "__args__", ())
        for t in (base, *args):
            if isinstance(t, type) and issubclass(t, enum.Enum):
                return "expected one of " + ", ".join(m.value for m in t)
    return reason


@functools.cache
def _sections() -> dict[str, type]:
    """Every section's name and struct, in ``EngineConfig``'s order."""
    return {f.name: f.type for f in msgspec.structs.fields(EngineConfig)}


def _field_type(section: str, key: str) -> Any:
    cls = _sections().get(section)
    if cls is None:
        return None
    for f in msgspec.structs.fields(cls):
        if f.name == key:
            return f.type
    return None


def _explain(message: str, data: dict[str, Any]) -> str:
    """Turn msgspec's message into one naming the dotted key and the offending value."""
    if re.match(r"^\S+\.\S+ = ", message):  # already ours (raised by a section's __post_init__)
        return re.sub(r" - at `\$[^`]*`$", "", message)
    m = re.search(r" - at `\$\.?([^`]*)`", message)
    where = m.group(1) if m else ""
    reason = message[: m.start()] if m else message
    unknown = re.search(r"unknown field `([^`]+)`", reason)
    if unknown:
        key = ".".join(p for p in (where, unknown.group(1)) if p)
        return f"{key}: unknown key"
    if reason.startswith(tuple(f"{s}." for s in _sections())):
        return reason  # a ConfigError message from a section's check, wrapped by msgspec
    node: Any = data
    for part in where.split(".") if where else []:
        node = node.get(part) if isinstance(node, dict) else None
    parts = where.split(".")
    if len(parts) == 2:
        reason = _enum_hint(reason, _field_type(*parts))
    return f"{where} = {node!r}: {reason}"
