"""Workloads shared by the live load generator, the cache-policy simulator and the cluster
bench. Torch-free.

A workload is a set of *sessions*. Each session starts with one root request; when a
request finishes, ``Workload.follow_ups(spec, reply_ids)`` returns the requests that
depend on its reply (none for independent requests, one for the next chat turn, several
where an agent trajectory branches), each to be sent ``delay_s`` after the reply (think
time, tool latency). The live load generator feeds it the replies the engine actually
generated; the simulator feeds ``synthetic_reply`` (deterministic, of the requested length).

Everything is deterministic under ``seed``: every piece of text comes from its own
``random.Random`` keyed by ``(seed, workload, what, session, turn, branch)``, so the
order in which concurrent sessions finish never changes what they send next.

Text is built from a fixed English word list, so a byte-level BPE tokenizer gives
realistic token counts; lengths are targets in tokens (the text stops at the first word
that reaches the target, so a prompt may run a few tokens over). Prompts go to the
engine as token ids, so every backend (engine, transformers, simulator) sees the same
tokens.

==================  ======================================================================
``chat``            N conversations x T turns; turn k+1 is the chat-template rendering of
                    the whole history including the reply actually generated; think time
``shared-prefix``   one long system prompt, unique questions
``prefix-repetition``  K prefixes x M suffixes each, shuffled
``shifted-prefix``  a shared prefix whose token length is not a multiple of the block
                    size, then long unique parts
``agent``           trajectories that grow by the model's outputs plus tool results and
                    branch into several continuations
``random``          no sharing (the control)
``long-reuse``      production-shaped conversations, open loop, heavy-tailed think times:
                    a turn's prefix comes back after hundreds of other requests
``tenants``         long per-tenant system prompts (Zipf popularity) with a volatile first
                    line; ``tenants-shift``: the popularity ranks move every few dozen sessions
``trace``           replay a JSONL file of {arrival_s, prompt | prompt_token_ids |
                    messages, max_tokens} (optional: session, turn)
==================  ======================================================================

Modules: ``codecs`` (tokenizers), ``text`` (English-like text), ``request`` (``RequestSpec``),
``workload`` (``WorkloadParams``, the ``Workload`` base), one module per workload family
(``chat``, ``agent``, ``tree``, ``tenants``, ``independent``, ``long_reuse``, ``trace``), ``registry``
(workloads by name), ``replies`` (synthetic replies, ``expand``), ``arrivals`` and ``cli``
(the flags loadgen, the simulator and the cluster bench share).
"""

from deltaserve.tools.workloads.agent import AgentWorkload, SWEAgentWorkload
from deltaserve.tools.workloads.arrivals import DEFAULT_CONCURRENCY, ArrivalParams, plan_arrivals
from deltaserve.tools.workloads.chat import ChatWorkload, MultiTurnWorkload
from deltaserve.tools.workloads.cli import add_workload_args, arrival_from_args, params_from_args
from deltaserve.tools.workloads.codecs import (
    Codec,
    HFCodec,
    SyntheticCodec,
    TokenizersCodec,
    builtin_model_dir,
    load_codec,
    render_chatml,
)
from deltaserve.tools.workloads.independent import (
    PrefixRepetitionWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    ShiftedPrefixWorkload,
)
from deltaserve.tools.workloads.long_reuse import LongReuseWorkload, describe_reuse, reuse_distances
from deltaserve.tools.workloads.registry import (
    LARGE_WORKLOADS,
    PRESSURE_WORKLOADS,
    VARIANT_WORKLOADS,
    WORKLOADS,
    make_workload,
    workload_names,
)
from deltaserve.tools.workloads.replies import expand, synthetic_reply
from deltaserve.tools.workloads.request import RequestSpec, common_prefix_len, prompt_hash
from deltaserve.tools.workloads.tenants import TenantsShiftWorkload, TenantsWorkload
from deltaserve.tools.workloads.text import WORDS, TextMaker
from deltaserve.tools.workloads.trace import MOONCAKE_BLOCK_TOKENS, TraceWorkload
from deltaserve.tools.workloads.tree import TreeWorkload
from deltaserve.tools.workloads.workload import SLOT, Workload, WorkloadParams

__all__ = [
    "DEFAULT_CONCURRENCY",
    "LARGE_WORKLOADS",
    "MOONCAKE_BLOCK_TOKENS",
    "PRESSURE_WORKLOADS",
    "SLOT",
    "VARIANT_WORKLOADS",
    "WORDS",
    "WORKLOADS",
    "AgentWorkload",
    "ArrivalParams",
    "ChatWorkload",
    "Codec",
    "HFCodec",
    "LongReuseWorkload",
    "MultiTurnWorkload",
    "PrefixRepetitionWorkload",
    "RandomWorkload",
    "RequestSpec",
    "SWEAgentWorkload",
    "SharedPrefixWorkload",
    "ShiftedPrefixWorkload",
    "SyntheticCodec",
    "TenantsShiftWorkload",
    "TenantsWorkload",
    "TextMaker",
    "TokenizersCodec",
    "TraceWorkload",
    "TreeWorkload",
    "Workload",
    "WorkloadParams",
    "add_workload_args",
    "arrival_from_args",
    "builtin_model_dir",
    "common_prefix_len",
    "describe_reuse",
    "expand",
    "load_codec",
    "make_workload",
    "params_from_args",
    "plan_arrivals",
    "prompt_hash",
    "render_chatml",
    "reuse_distances",
    "synthetic_reply",
    "workload_names",
]
