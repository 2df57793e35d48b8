"""What ``EngineCore`` is built from: the device, dtype and kernels of ``[model]`` /
``[kernels]``, the loaded model's shape and prefill cost, the cache capacity on the device, and
the model runner sized to it. Called once per engine; torch (the torch-free half of capacity
planning is ``engine/core/sizing.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deltaserve.cache.disk_format import StoreIdentity
from deltaserve.cache.disk_store import DiskStore, DiskStoreError
from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.layered_store import LayeredStore
from deltaserve.cache.manager import CacheManager
from deltaserve.cache.remote_client import MooncakeClient, mooncake_import_error
from deltaserve.cache.remote_store import RemoteStore
from deltaserve.cache.remote_tier import RemoteTier
from deltaserve.engine.byte_size import format_bytes
from deltaserve.engine.config import DType, EngineConfig, StateDType
from deltaserve.engine.config_base import chosen_state_dtype
from deltaserve.engine.config_spec import SpecMethod
from deltaserve.engine.core.kv_events_hook import CoreKVEvents
from deltaserve.engine.core.sizing import Capacity, ModelShape, plan_capacity
from deltaserve.engine.errors import ConfigError
from deltaserve.engine.front.client import ModelInfo
from deltaserve.engine.front.input_processor import InputProcessor
from deltaserve.engine.runner.disk_io import DiskIO, identity
from deltaserve.engine.runner.model_runner import ModelRunner, RunnerSizes
from deltaserve.kernels import Ops, get_ops
from deltaserve.logs import get_logger
from deltaserve.models import CacheSpec, LoadedModel, load_model
from deltaserve.models.loader import UnsupportedModelError

log = get_logger("deltaserve.engine")

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
STATE_DTYPES = {StateDType.FLOAT32: torch.float32, StateDType.BFLOAT16: torch.bfloat16}


def load_engine_model(
    config: EngineConfig, loaded: LoadedModel | None, dtype: torch.dtype, device: torch.device, ops: Ops
) -> tuple[LoadedModel, CacheSpec]:
    """The model (``loaded`` when given) and its caches: with the MTP head and its KV layers
    exactly when ``speculative.method = "mtp"`` (a one-line ``ConfigError`` when the model has
    none, or ``loaded`` was loaded without it)."""
    want_mtp = config.speculative.method is SpecMethod.MTP
    if loaded is None:
        try:
            loaded = load_model(
                config.model.path,
                dtype=dtype,
                device=device,
                ops=ops,
                tokenizer=config.model.tokenizer,
                load_mtp=want_mtp,
            )
        except UnsupportedModelError as e:
            if not want_mtp:
                raise
            raise ConfigError(f"speculative.method = 'mtp': {e}") from e
    if want_mtp and loaded.model.mtp is None:
        raise ConfigError(
            "speculative.method = 'mtp': the model was loaded without its MTP head (load_model(load_mtp=True))"
        )
    ssm_dtype = resolve_state_dtype(config, loaded)
    return loaded, loaded.model.cache_spec(with_mtp=want_mtp, ssm_dtype=ssm_dtype)


def resolve_state_dtype(config: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """The torch dtype of ``model.ssm_state_dtype`` (``auto``: the model config's
    ``mamba_ssm_dtype`` when it names float32 or bfloat16, else float32). Pins the config to
    the concrete value, as ``resolve_device`` does the model dtype: a checkpoint store, and the
    prefix-cache salt, must name the state that runs."""
    chosen, reason = chosen_state_dtype(
        config.model.ssm_state_dtype, getattr(loaded.hf_config, "mamba_ssm_dtype", None)
    )
    config.model.ssm_state_dtype = chosen
    log.info("engine.ssm_state_dtype", dtype=chosen.value, reason=reason)
    return STATE_DTYPES[chosen]


def salt_parts(config: EngineConfig, loaded: LoadedModel) -> tuple[str, ...]:
    """What every prefix-cache hash is salted with: the model, the dtypes that run and the
    namespace. A bfloat16 state is named (float32, the default, is not: the hashes a float32
    engine has always written stay valid), so states of two dtypes never answer each other."""
    parts = (str(loaded.path), config.model.dtype.value, config.cache.namespace)
    state = config.model.ssm_state_dtype
    return parts if state is StateDType.FLOAT32 else (*parts, f"ssm_state={state.value}")


def build_input_processor(
    config: EngineConfig,
    loaded: LoadedModel,
    tokenizer: Any,
    max_model_len: int,
    defaults: Mapping[str, Any] | None,
) -> InputProcessor:
    """The core's input door: checks and tokenizes requests against this model and its limits,
    salting their prefix-cache keys with ``salt_parts``; ``defaults``: the model's request
    defaults (``model_files.sampling_defaults``)."""
    return InputProcessor(
        tokenizer,
        max_model_len=max_model_len,
        vocab_size=int(loaded.hf_config.vocab_size),
        salt_parts=salt_parts(config, loaded),
        sampling_defaults=defaults,
    )


def resolve_dtype(name: str | DType, device: torch.device) -> torch.dtype:
    """The torch dtype of ``model.dtype`` (``auto``: bfloat16 on CUDA, float32 elsewhere)."""
    dtype = DType(name)
    if dtype is DType.AUTO:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[dtype]


#: below this many bytes of weights a CPU engine runs torch on one thread by default: its ops are
#: too small to split (the built-in tiny model's chat load test ran at 360 output tokens/s on one
#: thread, 270 on two, on 2 cores), while a real model's GEMMs scale with threads
SMALL_MODEL_BYTES = 256 * 1024**2


def cpu_threads(config: EngineConfig, device: torch.device, weight_bytes: int) -> int | None:
    """Set torch's intra-op threads for a CPU engine (``engine.cpu_threads``; 0:
    ``default_cpu_threads``); the count set, or None on another device."""
    if device.type != "cpu":
        return None
    n = config.engine.cpu_threads or default_cpu_threads(os.environ, weight_bytes)
    torch.set_num_threads(n)
    return n


def default_cpu_threads(environ: Mapping[str, str], weight_bytes: int) -> int:
    """``OMP_NUM_THREADS`` when it is a positive integer; else 1 for a model of less than
    ``SMALL_MODEL_BYTES`` of weights, every CPU this process may use for a larger one.

    Every CPU, not one fewer for the front end: a decode step is bound by memory bandwidth and
    a prefill by GEMM rate, and both scale with threads on a dedicated machine (2 cores, the
    0.8B shape: decode at 4 sequences 191 -> 128 ms, a 512-token prefill 3.7 -> 2.1 s), while
    the front end and the tokenizer sleep through most of a step. A machine shared with other
    busy processes is the exception (a forward waits for its descheduled thread); there
    ``engine.cpu_threads`` or ``OMP_NUM_THREADS`` says how many to use.
    """
    raw = environ.get("OMP_NUM_THREADS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    if weight_bytes < SMALL_MODEL_BYTES:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def choose_device(name: str, cuda_available: bool | None = None) -> tuple[torch.device, str]:
    """``model.device`` as a torch device and why: ``auto`` is CUDA when torch sees a GPU
    (``cuda_available``, default ``torch.cuda.is_available()``), else the CPU."""
    if name != "auto":
        return torch.device(name), "configured"
    if torch.cuda.is_available() if cuda_available is None else cuda_available:
        return torch.device("cuda"), "auto: CUDA available"
    return torch.device("cpu"), "auto: no CUDA"


def resolve_device(config: EngineConfig) -> torch.device:
    """``model.device`` as a torch device; ``ConfigError`` if it is not there.

    Pins ``config.model.device`` and ``config.model.dtype`` to the concrete values chosen (no
    ``auto`` left), so what is derived from the config after this (the prefix-cache salt, the
    disk tier's identity, model info) names what runs: a bf16 store must not be served to a
    float32 engine because both configs said ``auto``. Logs ``engine.device`` with the reason."""
    device, reason = choose_device(config.model.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"model.device = {config.model.device!r}: CUDA is not available on this machine"
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"model.device = {config.model.device!r}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    dtype = resolve_dtype(config.model.dtype, device)
    dtype_reason = (
        f"auto: {'CUDA' if device.type == 'cuda' else 'CPU'}"
        if config.model.dtype is DType.AUTO
        else "configured"
    )
    config.model.device = str(device)
    config.model.dtype = DTYPE_NAMES[dtype]
    log.info(
        "engine.device",
        device=str(device),
        device_reason=reason,
        dtype=str(dtype).removeprefix("torch."),
        dtype_reason=dtype_reason,
    )
    return device


def model_shape(loaded: LoadedModel, spec: CacheSpec, *, host_resident: bool = False) -> ModelShape:
    """The torch-free numbers capacity planning and the cache's value model need;
    ``host_resident`` (a CPU engine): also the weights' bytes and the widths that size one
    step's activations, for the capacity line's ``expected_rss_mib``."""
    per_token, per_pair = prefill_flops(loaded, spec)
    weights, widest = weight_footprint(loaded.model) if host_resident else (0, 0)
    return ModelShape(
        weight_bytes=weights,
        widest_features=widest,
        vocab_size=int(loaded.hf_config.vocab_size) if host_resident else 0,
        kv_bytes_per_token=spec.kv_block_bytes(1) if spec.num_attn_layers else 0,
        state_bytes=spec.state_slot_bytes() if spec.num_gdn_layers else 0,
        padded_state_bytes=spec.padded_state_bytes() if spec.num_gdn_layers else 0,
        max_position_embeddings=loaded.max_position_embeddings,
        gdn_chunk_size=spec.gdn_chunk_size,
        prefill_flops_per_token=per_token,
        prefill_flops_per_token_pair=per_pair,
    )


def weight_footprint(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the model's parameters and buffers (a tied tensor counted once), and the widest
    output of a linear projection other than the lm_head (whose logits are taken for sampled
    rows only)."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    widest = max(
        (
            m.out_features
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"
        ),
        default=0,
    )
    return total, widest


def prefill_flops(loaded: LoadedModel, spec: CacheSpec) -> tuple[float, float]:
    """Prefill cost of the model: FLOPs per token (2 x the weights a token passes through:
    projections, MLPs, the routed share of the experts; not the embedding lookup nor the
    lm_head, which runs on sampled rows only) and per (token, earlier token) pair of the
    full-attention layers (QK^T and PV: 4 x query heads x head_dim each)."""
    cfg = loaded.hf_config
    routed = getattr(cfg, "num_experts_per_tok", 0) / max(getattr(cfg, "num_experts", 0) or 1, 1)
    weights = 0.0
    for name, p in loaded.model.named_parameters():
        if "embed_tokens" in name or name.startswith("lm_head"):
            continue
        weights += p.numel() * (routed if ".experts." in name else 1.0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(cfg, "head_dim", 0) or (cfg.hidden_size // heads if heads else 0))
    return 2.0 * weights, 4.0 * heads * head_dim * spec.num_attn_layers


def cuda_cache_budget(
    config: EngineConfig, runner_probe: Callable[[], Any], device: torch.device
) -> int | None:
    """The cache budget on CUDA, after loading the weights and a profiling forward: None when
    ``cache.memory_bytes`` is set (the budget is then that many bytes, as vLLM's
    ``kv_cache_memory_bytes``: a fixed size that does not move with what else the card holds),
    once it is checked to fit in the memory the device has left; else
    ``gpu_memory_utilization`` x device memory minus what the process holds and the
    activation peak."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner_probe()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    used_by_others = max(total - free - torch.cuda.memory_reserved(device), 0)
    fixed = config.cache.memory_bytes
    if fixed is not None:
        left = total - peak - used_by_others
        if fixed > left:
            raise ConfigError(
                f"cache.memory_bytes = {format_bytes(fixed)}: the device has {format_bytes(max(left, 0))} left "
                f"of {total / 2**30:.1f} GiB after the weights and activations ({peak / 2**30:.2f} GiB) "
                f"and other processes ({used_by_others / 2**30:.2f} GiB)"
            )
        # said once at start: a config written for the CPU (examples/serve.toml) sizes the
        # GPU's cache too, which the utilization share would have made larger
        log.info("engine.cache_budget", source="cache.memory_bytes", budget=format_bytes(fixed),
                 device_left=format_bytes(left))  # fmt: skip
        return None
    budget = int(config.cache.gpu_memory_utilization * total) - peak - used_by_others
    if budget <= 0:
        raise ConfigError(
            f"cache.gpu_memory_utilization = {config.cache.gpu_memory_utilization}: {total / 2**30:.1f} GiB device, "
            f"weights + activations take {peak / 2**30:.2f} GiB, nothing is left for the cache"
        )
    return budget


def resolve_ops(config: EngineConfig, device: torch.device) -> Ops:
    """The kernels of ``kernels.backend`` on ``device``; ``ConfigError`` if it has none there."""
    try:
        return get_ops(config.kernels.backend.value, device)
    except NotImplementedError as e:
        raise ConfigError(f"kernels.backend = {config.kernels.backend.value!r}: {e}") from None


def plan_engine_capacity(
    config: EngineConfig, loaded: LoadedModel, spec: CacheSpec, ops: Ops, device: torch.device
) -> Capacity:
    """The cache capacity of this model on this device: on CUDA from the memory left after the
    weights and a profiling forward, elsewhere from the configured budget."""
    budget = None
    if device.type == "cuda":
        tokens, bs = config.scheduler.max_num_batched_tokens, config.cache.block_size
        budget = cuda_cache_budget(
            config, lambda: ModelRunner.profile(loaded, ops, tokens, bs, device), device
        )
    shape = model_shape(loaded, spec, host_resident=device.type == "cpu")
    return plan_capacity(config, shape, budget_bytes=budget)


def build_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    spec: CacheSpec,
    ops: Ops,
    capacity: Capacity,
    cache: CacheManager,
    device: torch.device,
) -> ModelRunner:
    """The model runner with cache tensors for ``capacity`` and the cache manager's state
    slots, its sampling generator seeded by ``model.seed``."""
    sizes = RunnerSizes(
        capacity.num_kv_blocks if spec.num_attn_layers else 1,
        config.cache.block_size,
        cache.slots.num_live,
        cache.slots.num_checkpoint,
        capacity.num_host_kv_blocks,
        capacity.num_host_checkpoint_slots,
        num_pages=capacity.num_pages,
        num_host_pages=capacity.num_host_pages,
    )
    runner = ModelRunner(loaded, ops, sizes, device, spec=spec)
    runner.default_generator.manual_seed(config.model.seed)
    return runner


def model_info(config: EngineConfig, loaded: LoadedModel, capacity: Capacity, unit: int) -> ModelInfo:
    """The ``ModelInfo`` an engine serves (``unit``: the cache's checkpoint unit)."""
    return ModelInfo(
        name=str(config.model.path),
        model_type=loaded.model_type,
        max_model_len=capacity.max_model_len,
        vocab_size=int(loaded.hf_config.vocab_size),
        block_size=config.cache.block_size,
        checkpoint_unit=unit,
        capacity=capacity.describe(),
    )


def open_disk_tier(
    config: EngineConfig, loaded: LoadedModel, spec: CacheSpec, cache: CacheManager, runner: ModelRunner
) -> DiskTier | None:
    """The disk tier of ``cache.disk_path`` (None when unset), attached to the cache and the
    runner. A store of another model or format is set aside by the store; a path another
    engine holds, or a non-empty folder that is not a store, is a ``ConfigError``. A model
    the tier cannot serve (no GDN layers) logs a warning and runs without it."""
    c = config.cache
    if c.disk_path is None and c.remote is None:
        return None
    if not (cache.enabled and cache.has_gdn and spec.num_attn_layers):
        log.warning("disk.off", reason="the disk tier serves hybrid models (GDN and attention layers)")
        return None
    ident = identity(loaded, runner.caches, c.block_size, spec.gdn_chunk_size)
    if c.remote is not None:
        return open_remote_tier(config, ident, cache, runner)
    store = open_disk_store(config, ident)
    return _attach_tier(
        DiskTier, store, config, ident, cache, runner, c.disk_write_bytes_per_s, c.disk_read_timeout_s
    )


def _attach_tier(
    cls: type[DiskTier],
    store: Any,
    config: EngineConfig,
    ident: StoreIdentity,
    cache: CacheManager,
    runner: ModelRunner,
    write_bytes_per_s: float | None,
    read_timeout_s: float | None,
) -> DiskTier:
    """A tier of class ``cls`` over ``store``, plugged into the cache's and the runner's one
    disk socket (the disk and the remote tier differ only in their store and rates)."""
    tier = cls(
        store,
        block_size=config.cache.block_size,
        unit_blocks=cache.unit // config.cache.block_size,
        kv_block_bytes=ident.kv_block_bytes,
        checkpoint_bytes=ident.checkpoint_bytes,
        write_bytes_per_s=write_bytes_per_s,
        read_buffer_bytes=config.cache.disk_read_buffer_bytes,
        read_timeout_s=read_timeout_s,
    )
    cache.attach_disk(tier)
    runner.disk = DiskIO(store)
    return tier


def open_events_and_disk(
    config: EngineConfig, loaded: LoadedModel, spec: CacheSpec, cache: CacheManager, runner: ModelRunner
) -> tuple[CoreKVEvents | None, DiskTier | None]:
    """The cache-event publisher (``kv_events``; None when off), then the disk (or remote) tier.
    The publisher binds first, so a port in use fails before the disk store is locked; its first
    batch says the cache starts empty but for what the disk holds."""
    events = CoreKVEvents.open(config.kv_events, cache)
    try:
        disk = open_disk_tier(config, loaded, spec, cache, runner)
    except BaseException:
        if events is not None:
            events.close()
        raise
    if events is not None:
        events.start(disk)
    return events, disk


def open_disk_store(config: EngineConfig, ident: StoreIdentity) -> DiskStore:
    c = config.cache
    assert c.disk_path is not None
    try:
        return DiskStore(c.disk_path, c.disk_bytes, ident)
    except DiskStoreError as e:
        raise ConfigError(f"cache.disk_path = {c.disk_path!r}: {e}") from None


def open_remote_tier(
    config: EngineConfig, ident: StoreIdentity, cache: CacheManager, runner: ModelRunner
) -> DiskTier:
    """The remote tier on ``cache.remote`` (``cache/remote_tier.py``) in the disk tier's socket.
    A missing ``mooncake`` package is a ``ConfigError``; a store that is down is not (the
    tier connects in the background and misses until it answers)."""
    c = config.cache
    assert c.remote is not None
    why = mooncake_import_error()
    if why is not None:
        raise ConfigError(f"cache.remote = {c.remote!r}: the mooncake package cannot be imported ({why})")
    client = MooncakeClient(
        c.remote,
        segment_bytes=c.remote_segment_bytes,
        buffer_bytes=c.remote_buffer_bytes,
        timeout_s=c.remote_timeout_s,
    )
    remote = RemoteStore(client, ident)
    store = remote if c.disk_path is None else LayeredStore(open_disk_store(config, ident), remote)
    tier = _attach_tier(
        RemoteTier, store, config, ident, cache, runner, c.remote_write_bytes_per_s, c.remote_timeout_s
    )
    log.info("remote.opened", url=c.remote, namespace=remote.ns, disk_layer=c.disk_path is not None)
    return tier


def close_disk_tier(tier: DiskTier, cache: CacheManager, runner: ModelRunner) -> None:
    """Write every cached checkpoint the disk lacks (with its KV path), flush, unlock; the
    cache and the runner go on without a disk tier. No step may be running."""
    try:
        tier.plan_all(cache.tree.nodes())
        if runner.disk is not None:
            runner.disk.save(tier.take_saves(), runner.caches, runner.host.caches if runner.host else None)
    finally:
        cache.detach_disk()
        runner.disk = None
        tier.close()
        log.info("disk.closed", **tier.store.stats())
