"""vLLM's and llama-server's ``serve`` flags: one table (``FLAGS``) that ``deltaserve serve --help``,
the refusals and the docs table (docs/server.md, "From vLLM / from llama-server") all come from.

Each row is one flag as the other server spells it, and what it does here:

``KEY``
    A shorthand of an engine config key (``--set KEY=VALUE``): the value goes into the
    overrides ``engine_key_overrides`` builds; ``--set`` still overrides it. Two flags that set
    one key to different values (``--max-model-len 4096 -c 8192``) are a ``ConfigError``.
``SERVER``
    A ``ServerConfig`` field (ssl, root path, uvicorn's log level, a served model name).
``SAME``
    Spelled and meaning the same as deltaserve's own option (registered in ``server/cli.py``);
    listed so the docs table is complete.
``ACCEPTED``
    Needs nothing here (what it asks for is what deltaserve always does): parsed, its value
    dropped, and all of them logged in one ``serve.flags_accepted`` line at start.
``REFUSED``
    A capability deltaserve lacks: the command exits 2 with one line saying what to use instead,
    while the command line is parsed (before anything loads). A value in ``allowed`` is the
    one thing deltaserve does anyway (``--tensor-parallel-size 1``, ``--kv-cache-dtype auto``)
    and is accepted like an ``ACCEPTED`` flag.

The tool parser name vLLM's Qwen3.5 / Qwen3-Coder recipes use, ``qwen3_coder``, is an alias of
``qwen3_xml`` (``TOOL_PARSER_ALIASES``).
"""

from __future__ import annotations

import argparse
import enum
import errno
import ipaddress
import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.byte_size import bytes_arg
from deltaserve.engine.errors import ConfigError
from deltaserve.logs import get_logger
from deltaserve.server.config import API_KEY_ENV, ServerConfig

log = get_logger("deltaserve.server")


class Kind(str, enum.Enum):
    KEY = "key"
    SERVER = "server"
    SAME = "same"
    ACCEPTED = "accepted"
    REFUSED = "refused"


class Arity(str, enum.Enum):
    """How many values a flag takes on the command line."""

    ONE = "one"  # --flag VALUE
    NONE = "none"  # --flag
    OPTIONAL = "optional"  # --flag [VALUE]
    BOOL = "bool"  # --flag / --no-flag


@dataclass(frozen=True)
class Flag:
    """One row of the table (module docstring). ``target``: the config key (``KEY``) or the
    ``ServerConfig`` field (``SERVER``); ``note``: the help text, or for ``ACCEPTED`` / ``REFUSED``
    why nothing is needed / what to use instead; ``const``: the value an ``Arity.NONE`` flag sets."""

    names: tuple[str, ...]
    origin: str  # "vLLM", "llama-server" or "vLLM, llama-server"
    kind: Kind
    note: str
    target: str = ""
    arity: Arity = Arity.ONE
    type: Callable[[str], Any] = str
    metavar: str | None = None
    const: Any = None
    allowed: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """The argparse dest: the first long name's (``--max-num-seqs`` -> ``max_num_seqs``)."""
        long = next((n for n in self.names if n.startswith("--")), self.names[0])
        return "compat_" + long.lstrip("-").replace("-", "_")

    @property
    def shown(self) -> str:
        if self.arity is Arity.BOOL:
            return " / ".join(f"{n}, --no-{n[2:]}" if n.startswith("--") else n for n in self.names)
        return ", ".join(self.names)


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (vLLM's ``--kv-events-config '{...}'``); its keys become the
    section's (``engine_key_overrides``), checked as any config key is."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


V, L, B = "vLLM", "llama-server", "vLLM, llama-server"
K, S, SAME, A, R = Kind.KEY, Kind.SERVER, Kind.SAME, Kind.ACCEPTED, Kind.REFUSED
REPLICAS_HINT = "one GPU per engine here; for data parallelism run --replicas N (docs/cluster.md)"

FLAGS: tuple[Flag, ...] = (
    # --- the same name and meaning as deltaserve's own options (server/cli.py)
    Flag(("MODEL", "--model"), V, SAME, "model.path: a Hugging Face-format folder or builtin:NAME"),
    Flag(("-m",), L, SAME, "model.path (a Hugging Face-format folder, not a GGUF file)"),
    Flag(("--host",), B, SAME, "address to listen on (default 0.0.0.0, as vLLM's)"),
    Flag(("--port",), B, SAME, "port (default 8000)"),
    Flag(("--api-key",), B, SAME, "the bearer key every route but the probes needs"),
    Flag(("--served-model-name",), V, SAME, "the name(s) clients send as `model`"),
    Flag(("--tokenizer",), V, SAME, "model.tokenizer"),
    Flag(("--dtype",), V, SAME, "model.dtype (auto | bfloat16 | float16 | float32)"),
    Flag(("--max-model-len",), V, SAME, "model.max_model_len"),
    Flag(("--gpu-memory-utilization",), V, SAME, "cache.gpu_memory_utilization"),
    Flag(("--tool-call-parser",), V, SAME, "qwen3_xml (alias qwen3_coder) | hermes | none | auto"),
    Flag(("--reasoning-parser",), V, SAME, "qwen3 | none | auto"),
    Flag(("--allowed-origins",), V, SAME, "CORS (also --allowed-methods, --allowed-headers, --allow-credentials)"),
    # --- shorthands of engine config keys
    Flag(("--max-num-seqs",), V, K, "most requests running at once", "scheduler.max_num_seqs", type=int, metavar="N"),
    Flag(("-np", "--parallel"), L, K, "most requests running at once", "scheduler.max_num_seqs", type=int, metavar="N"),
    Flag(("--max-num-batched-tokens",), V, K, "token budget of one step", "scheduler.max_num_batched_tokens",
         type=int, metavar="N"),
    Flag(("-b", "--batch-size"), L, K, "token budget of one step", "scheduler.max_num_batched_tokens",
         type=int, metavar="N"),
    Flag(("--max-num-partial-prefills",), V, K, "prompts left partially prefilled at once",
         "scheduler.max_num_partial_prefills", type=int, metavar="N"),
    Flag(("--long-prefill-token-threshold",), V, K, "most prompt tokens per request per step (0: no limit)",
         "scheduler.long_prefill_token_threshold", type=int, metavar="N"),
    Flag(("--enable-chunked-prefill",), V, K, "split long prompts across steps", "scheduler.enable_chunked_prefill",
         arity=Arity.BOOL),
    Flag(("--scheduling-policy",), V, K, "fcfs | priority | lpm | sjf", "scheduler.policy", metavar="P"),
    Flag(("--enable-prefix-caching",), V, K, "reuse cached prefixes", "cache.enable_prefix_caching",
         arity=Arity.BOOL),
    Flag(("--block-size",), V, K, "tokens per KV block", "cache.block_size", type=int, metavar="N"),
    Flag(("--kv-cache-memory-bytes",), V, K, "the cache's bytes (KV, checkpoints and live states; 4G, 8GiB, ...), "
         "instead of the --gpu-memory-utilization share", "cache.memory_bytes", type=bytes_arg, metavar="SIZE"),
    Flag(("--mamba-ssm-cache-dtype",), V, K, "the recurrent state's dtype, live and checkpointed: auto | float32 | "
         "bfloat16", "model.ssm_state_dtype", metavar="DTYPE"),
    Flag(("--num-gpu-blocks-override",), V, K, "explicit number of KV blocks", "cache.num_kv_blocks",
         type=int, metavar="N"),
    Flag(("--seed",), V, K, "seed of requests without their own", "model.seed", type=int, metavar="N"),
    Flag(("-c", "--ctx-size"), L, K, "longest sequence (prompt + output)", "model.max_model_len",
         type=int, metavar="N"),
    Flag(("--generation-config",), V, K, "request defaults: auto (the model's generation_config.json) | vllm "
         "(none) | FOLDER", "model.generation_config", metavar="G"),
    Flag(("--chat-template",), V, K, "a Jinja chat template file used instead of the tokenizer's",
         "model.chat_template", metavar="FILE"),
    Flag(("-t", "--threads"), L, K, "torch threads on the CPU (0: all)", "engine.cpu_threads", type=int, metavar="N"),
    Flag(("--slot-save-path",), L, K, "the disk tier's folder (cached prefixes survive a restart)",
         "cache.disk_path", metavar="DIR"),
    Flag(("--async-scheduling",), V, K, "overlap the host work with the model", "engine.async_scheduling",
         arity=Arity.NONE, const=True),
    Flag(("--kv-events-config",), V, K, "cache events in vLLM's format over ZeroMQ: a JSON object of its keys "
         "(enable_kv_cache_events, endpoint, replay_endpoint, ...; docs/cluster.md)", "kv_events",
         type=json_object, metavar="JSON"),
    Flag(("--disable-log-stats",), V, K, "no periodic engine.stats lines", "logging.stats_interval_s",
         arity=Arity.NONE, const=0.0),
    # --- ServerConfig fields
    Flag(("-a", "--alias"), L, S, "a name clients send as `model` (as --served-model-name)", "served_model_names",
         metavar="NAME"),
    Flag(("--ssl-keyfile",), V, S, "TLS private key (PEM)", "ssl_keyfile", metavar="FILE"),
    Flag(("--ssl-certfile",), V, S, "TLS certificate chain (PEM); serves https", "ssl_certfile", metavar="FILE"),
    Flag(("--ssl-ca-certs",), V, S, "CA certificates to verify clients' certificates", "ssl_ca_certs",
         metavar="FILE"),
    Flag(("--root-path",), V, S, "the path prefix a proxy strips (uvicorn's root_path)", "root_path",
         metavar="PATH"),
    Flag(("--uvicorn-log-level",), V, S, "uvicorn's log level (critical | error | warning | info | debug | trace)",
         "uvicorn_log_level", metavar="LEVEL"),
    # --- need nothing here
    Flag(("--enable-auto-tool-choice",), V, A, "tool_choice auto is always served; --tool-call-parser picks "
         "the format", arity=Arity.NONE),
    Flag(("--trust-remote-code",), V, A, "no code is run from the model folder (deltaserve's own model classes)",
         arity=Arity.NONE),
    Flag(("--disable-log-requests",), V, A, "no per-request log lines unless --access-log", arity=Arity.NONE),
    Flag(("--disable-uvicorn-access-log",), V, A, "no access log unless --access-log", arity=Arity.NONE),
    Flag(("--enforce-eager",), V, A, "no CUDA graphs here: always eager", arity=Arity.NONE),
    Flag(("--language-model-only",), V, A, "text only: vision weights are never loaded", arity=Arity.NONE),
    Flag(("--swap-space",), V, A, "preempted requests are recomputed, never swapped (a host cache tier: "
         "--set cache.host_memory_bytes=...)", metavar="GIB"),
    Flag(("--jinja",), L, A, "chat templates are always Jinja", arity=Arity.NONE),
    Flag(("-ngl", "--n-gpu-layers", "--gpu-layers"), L, A, "the whole model runs on --device", metavar="N"),
    Flag(("-fa", "--flash-attn"), L, A, "kernels are chosen by kernels.backend", arity=Arity.OPTIONAL,
         metavar="on|off|auto", allowed=("on", "off", "auto")),
    Flag(("--cont-batching",), L, A, "batching is always continuous", arity=Arity.NONE),
    # --- capabilities deltaserve lacks
    Flag(("-tp", "--tensor-parallel-size"), V, R, REPLICAS_HINT, metavar="N", allowed=("1",)),
    Flag(("-pp", "--pipeline-parallel-size"), V, R, REPLICAS_HINT, metavar="N", allowed=("1",)),
    Flag(("-dp", "--data-parallel-size"), V, R, "use --replicas N (engine replicas on Ray Serve, docs/cluster.md)",
         metavar="N", allowed=("1",)),
    Flag(("-q", "--quantization"), V, R, "weights run in --dtype (bfloat16 | float16 | float32); serve an "
         "unquantized checkpoint", metavar="METHOD"),
    Flag(("--kv-cache-dtype",), V, R, "the KV cache is kept in the model's --dtype", metavar="DTYPE",
         allowed=("auto",)),
    Flag(("--speculative-config",), V, K, "speculative decoding, vLLM's JSON: method (ngram | replay | none), "
         "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min", "speculative",
         type=lambda text: speculative_config(text), metavar="JSON"),
    Flag(("--enable-lora",), V, R, "no LoRA adapters here: serve a merged checkpoint", arity=Arity.NONE),
    Flag(("--cpu-offload-gb",), V, R, "weights stay on --device; the cache has host and disk tiers "
         "(cache.host_memory_bytes, cache.disk_path)", metavar="GIB"),
    Flag(("-n", "--n-predict"), L, R, "send max_tokens in each request",
         metavar="N"),
    Flag(("--temp", "--top-p", "--top-k"), L, R, "send the sampling values in each request; the model's "
         "generation_config.json gives the defaults (--generation-config)", metavar="X"),
)  # fmt: skip

#: ``--speculative-config`` keys (vLLM's names) -> ``[speculative]`` keys
SPECULATIVE_KEYS = {
    "method": "method",
    "num_speculative_tokens": "num_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
}


def speculative_config(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON object (vLLM's keys) as the ``[speculative]`` section's
    keys; its values are checked by the section (a ``ConfigError`` naming the key)."""
    data = json_object(text)
    unknown = sorted(set(data) - set(SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key {unknown[0]!r} (known: {', '.join(SPECULATIVE_KEYS)})")
    return {SPECULATIVE_KEYS[k]: v for k, v in data.items()}


#: vLLM tool parser names that are one of ours under another name
TOOL_PARSER_ALIASES = {"qwen3_coder": "qwen3_xml"}

_ACCEPTED_DEST = "compat_accepted"


def refusal(flag: Flag, name: str, value: str | None) -> str:
    """The one line a refused flag exits with."""
    given = name if value is None else f"{name} {value}"
    return f"deltaserve serve: {given} is not supported: {flag.note}"


class _Accept(argparse.Action):
    """Records an ``ACCEPTED`` flag (and an allowed value of a ``REFUSED`` one) for the start log;
    a ``REFUSED`` flag exits 2 with its one line."""

    def __init__(self, *args: Any, flag: Flag, **kwargs: Any) -> None:
        self.flag = flag
        super().__init__(*args, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        value = values if isinstance(values, str) else None
        if self.flag.kind is Kind.REFUSED and value not in self.flag.allowed:
            parser.exit(2, refusal(self.flag, str(option), value) + "\n")
        if (
            self.flag.kind is Kind.ACCEPTED
            and value is not None
            and self.flag.allowed
            and value not in self.flag.allowed
        ):
            # an optional value took the next word (MODEL after -fa, say): never swallowed quietly
            expected = " | ".join(self.flag.allowed)
            parser.exit(2, f"deltaserve serve: {option} {value}: expected {expected} (put MODEL first)\n")
        accepted = list(getattr(ns, _ACCEPTED_DEST, None) or [])
        accepted.append(str(option) if value is None else f"{option} {value}")
        setattr(ns, _ACCEPTED_DEST, accepted)


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """Register every ``KEY``, ``SERVER``, ``ACCEPTED`` and ``REFUSED`` row on ``parser``."""
    groups = {
        Kind.KEY: parser.add_argument_group("vLLM / llama-server options (shorthands of --set keys)"),
        Kind.SERVER: parser.add_argument_group("vLLM / llama-server server options"),
        Kind.ACCEPTED: parser.add_argument_group("vLLM / llama-server options accepted with no effect here"),
        Kind.REFUSED: parser.add_argument_group("vLLM / llama-server options refused here (exit 2)"),
    }
    parser.set_defaults(**{_ACCEPTED_DEST: []})
    nargs = {Arity.ONE: None, Arity.NONE: 0, Arity.OPTIONAL: "?"}
    for flag in FLAGS:
        if flag.kind is Kind.SAME:
            continue
        group = groups[flag.kind]
        if flag.kind in (Kind.ACCEPTED, Kind.REFUSED):
            group.add_argument(
                *flag.names, action=_Accept, flag=flag, nargs=nargs[flag.arity], metavar=flag.metavar,
                dest=flag.dest, default=argparse.SUPPRESS,
                help=("refused: " if flag.kind is Kind.REFUSED else "no effect: ") + flag.note
                + (f" ({' | '.join(flag.allowed)}: accepted)" if flag.allowed else ""),
            )  # fmt: skip
            continue
        where = f"--set {flag.target}" if flag.kind is Kind.KEY else f"server.{flag.target}"
        help_text = f"{where}: {flag.note}"
        if flag.target == "served_model_names":
            group.add_argument(*flag.names, dest="served_model_name", action="append", metavar=flag.metavar,
                               help=help_text)  # fmt: skip
        elif flag.arity is Arity.BOOL:
            group.add_argument(*flag.names, dest=flag.dest, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)  # fmt: skip
        elif flag.arity is Arity.NONE:
            group.add_argument(*flag.names, dest=flag.dest, action="store_const", const=flag.const,
                               default=None, help=help_text)  # fmt: skip
        else:
            group.add_argument(*flag.names, dest=flag.dest, type=flag.type, metavar=flag.metavar,
                               default=None, help=help_text)  # fmt: skip


def engine_key_overrides(args: argparse.Namespace, shorthands: dict[str, str]) -> dict[str, object]:
    """The engine config keys the ``KEY`` rows and ``shorthands`` (dest -> key, deltaserve's own
    options) set, only those given. Two options that give one key different values are a
    ``ConfigError`` naming both."""
    out: dict[str, object] = {}
    by: dict[str, str] = {}
    given: list[tuple[str, str, object]] = [
        ("--" + dest.replace("_", "-"), key, getattr(args, dest, None)) for dest, key in shorthands.items()
    ]
    given += [
        (flag.shown, flag.target, getattr(args, flag.dest, None)) for flag in FLAGS if flag.kind is Kind.KEY
    ]
    expanded: list[tuple[str, str, object]] = []
    for option, key, value in given:
        if isinstance(value, dict):  # an object (``--speculative-config``): a key of that section each
            expanded += [(option, f"{key}.{k}", v) for k, v in value.items()]
        else:
            expanded.append((option, key, value))
    for option, key, value in expanded:
        if value is None:
            continue
        if key in out and out[key] != value:
            raise ConfigError(f"{by[key]} {out[key]!r} and {option} {value!r} both set {key}: give one")
        out[key], by[key] = value, option
    return out


def server_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The ``ServerConfig`` fields the ``SERVER`` rows set (the served names excepted: those
    join ``--served-model-name``'s list)."""
    out: dict[str, object] = {}
    for flag in FLAGS:
        if flag.kind is Kind.SERVER and flag.target != "served_model_names":
            value = getattr(args, flag.dest, None)
            if value is not None:
                out[flag.target] = value
    return out


def accepted_flags(args: argparse.Namespace) -> list[str]:
    """The ``ACCEPTED`` flags given (with their values), for the one start log line."""
    return list(getattr(args, _ACCEPTED_DEST, None) or [])


def tool_parser_name(name: str) -> str:
    return TOOL_PARSER_ALIASES.get(name, name)


def docs_table(rows: Sequence[Flag] = FLAGS) -> str:
    """The Markdown table of docs/server.md's "From vLLM / from llama-server" section."""
    what = {
        Kind.KEY: lambda f: f"`--set {f.target}`: {f.note}",
        Kind.SERVER: lambda f: f"`server.{f.target}`: {f.note}",
        Kind.SAME: lambda f: f"the same: {f.note}",
        Kind.ACCEPTED: lambda f: f"accepted, no effect: {f.note}",
        Kind.REFUSED: lambda f: (
            f"refused (exit 2): {f.note}" + (f" (`{' | '.join(f.allowed)}` accepted)" if f.allowed else "")
        ),
    }
    lines = ["| flag | from | here |", "|---|---|---|"]
    # a "|" inside a cell would end it
    lines += [f"| `{f.shown}` | {f.origin} | {what[f.kind](f).replace('|', chr(92) + '|')} |" for f in rows]
    return "\n".join(lines)


def address_error(e: OSError, host: str, port: int) -> str | None:
    """The one line for a listening address that cannot be taken; None for any other error."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(e, socket.gaierror):
        return f"deltaserve serve: --host {host!r} is not an address ({e.strerror}); pass --host ADDRESS"
    if e.errno == errno.EADDRINUSE:
        return f"deltaserve serve: {shown} is already in use; pass --port N (0: any free port)"
    if e.errno == errno.EADDRNOTAVAIL:
        return (
            f"deltaserve serve: {host} is not an address of this machine; pass --host ADDRESS (0.0.0.0: all)"
        )
    if e.errno == errno.EACCES:
        return f"deltaserve serve: {shown}: permission denied (a port below 1024?); pass --port N"
    return None


def package_version() -> str:
    """The installed package's version (``deltaserve --version``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltaserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def uvicorn_logging(level: str | None) -> None:
    """``--uvicorn-log-level``: uvicorn's records at ``level`` and above to stderr, in the format
    of deltaserve's own lines (the server passes ``log_config=None`` to uvicorn, so its loggers
    have no handler of their own). Idempotent; None: nothing is changed."""
    import logging
    import sys

    if level is None:
        return
    logger = logging.getLogger("uvicorn")
    if not any(getattr(h, "_deltaserve", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        )
        handler._deltaserve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(5 if level == "trace" else level.upper())  # uvicorn's TRACE is 5


def log_start(args: argparse.Namespace) -> None:
    """One line for the vLLM / llama-server flags accepted with no effect."""
    accepted = accepted_flags(args)
    if accepted:
        log.info("serve.flags_accepted", flags=accepted, effect="none (docs/server.md: From vLLM)")


def warn_open_host(config: ServerConfig) -> None:
    """A warning when every client that reaches the port may use the model (vLLM's default,
    kept: not refused). Given when the server starts listening, not before: a start that
    fails (a bad model path, a budget too small) prints its one error line alone."""
    try:
        loopback = config.host == "localhost" or ipaddress.ip_address(config.host.strip("[]")).is_loopback
    except ValueError:  # a host name
        loopback = False
    if not loopback and config.api_key is None:
        log.warning(
            "serve.no_api_key", host=config.host, port=config.port,
            hint=f"any client that reaches this port may use the model: --api-key KEY (or ${API_KEY_ENV}), "
            "or --host 127.0.0.1",
        )  # fmt: skip
