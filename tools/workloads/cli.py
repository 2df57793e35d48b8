"""Command-line flags of the workloads and arrivals (shared by loadgen, the simulator and the
cluster bench), and the params they make."""

from __future__ import annotations

import argparse
from dataclasses import fields

from deltaserve.tools.workloads.arrivals import DEFAULT_CONCURRENCY, ArrivalParams
from deltaserve.tools.workloads.registry import PRESSURE_WORKLOADS, WORKLOADS
from deltaserve.tools.workloads.workload import WorkloadParams


def add_workload_args(parser: argparse.ArgumentParser, *, default: str = "chat", multi: bool = False) -> None:
    g = parser.add_argument_group("workload")
    names = ", ".join(WORKLOADS)
    if multi:
        g.add_argument(
            "--workload", default=default,
            help=f"comma list, 'all' (the small shapes) or 'pressure' ({', '.join(PRESSURE_WORKLOADS)}) of: {names}",
        )  # fmt: skip
    else:
        g.add_argument(
            "--workload", default=default, choices=list(WORKLOADS), help="workload (default %(default)s)"
        )
    g.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    g.add_argument("--num-requests", type=int, help="requests of an independent workload")
    g.add_argument("--sessions", type=int, help="chat conversations / agent trajectories")
    g.add_argument("--turns", type=int, help="turns per conversation / steps per trajectory")
    g.add_argument("--prefix-len", type=int, help="shared prefix / system prompt, tokens")
    g.add_argument("--prompt-len", type=int, help="unique part / question / user turn / task, tokens")
    g.add_argument("--output-len", type=int, help="max_tokens of every request")
    g.add_argument("--tool-len", type=int, help="agent tool results, tokens")
    g.add_argument("--num-prefixes", type=int, help="prefix-repetition: K prefixes")
    g.add_argument("--suffixes-per-prefix", type=int, help="prefix-repetition: M suffixes each")
    g.add_argument("--branches", type=int, help="agent: continuations at the fork")
    g.add_argument("--branch-at", type=int, help="agent: the turn whose reply forks the trajectory")
    g.add_argument(
        "--think-time", type=float, help="mean seconds between a reply and the next turn (exponential)"
    )
    g.add_argument("--len-jitter", type=float, help="unique lengths vary by +- this fraction (default 0.2)")
    g.add_argument(
        "--chat-tokenize", choices=["incremental", "full"], default="incremental",
        help="next turn = previous prompt ids + reply ids + new turn (incremental) or a re-tokenized rendering",
    )  # fmt: skip
    g.add_argument("--min-turns", type=int, help="multi-turn, swe-agent, tenants: fewest turns of a session")
    g.add_argument("--session-prefix-len", type=int, help="multi-turn: per-conversation prefix (mean tokens)")
    g.add_argument(
        "--replies", choices=["model", "recorded", "stripped"],
        help="what the next turn re-sends: the model's reply, a recorded one, or the reply with reasoning stripped",
    )  # fmt: skip
    g.add_argument("--depth", type=int, help="tree: levels below the root")
    g.add_argument("--beam", type=int, help="tree: children of an expanded node that are expanded")
    g.add_argument("--tenants", type=int, help="tenants: distinct system prompts")
    g.add_argument(
        "--volatile-every", type=int, help="tenants: sessions per change of the volatile first line"
    )
    g.add_argument("--shift-every", type=int, help="tenants-shift: sessions per popularity phase")
    g.add_argument("--shift-by", type=int, help="tenants-shift: ranks the popularity moves each phase")
    g.add_argument(
        "--trace", metavar="FILE",
        help="trace workload: JSONL to replay ({arrival_s, prompt|prompt_token_ids|messages, max_tokens} "
        "or Mooncake's {timestamp, input_length, output_length, hash_ids})",
    )  # fmt: skip
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival_s by this")
    a = parser.add_argument_group("arrivals")
    a.add_argument("--rate", type=float, help="open loop: Poisson arrivals of sessions/requests per second")
    a.add_argument(
        "--concurrency", type=int, help=f"closed loop: sessions in flight (default {DEFAULT_CONCURRENCY})"
    )


def params_from_args(
    args: argparse.Namespace, name: str | None = None, block_size: int = 16
) -> WorkloadParams:
    """The workload's parameters from ``add_workload_args``' options (each field of
    ``WorkloadParams`` is the option of its name; ``name`` and ``block_size`` are given)."""
    given = {"name": name or args.workload, "block_size": block_size}
    return WorkloadParams(
        **{
            f.name: given[f.name] if f.name in given else getattr(args, f.name)
            for f in fields(WorkloadParams)
        }
    )


def arrival_from_args(args: argparse.Namespace) -> ArrivalParams:
    return ArrivalParams(rate=args.rate, concurrency=args.concurrency)
