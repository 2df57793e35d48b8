"""Command-line plumbing shared by every tool: ``--config FILE``, ``--set section.key=value``,
and ``run_tool``, which turns a ``ConfigError`` into one line on stderr and exit status 2
(``tool-name: cache.memory_bytes = 1 is below the minimum ...``) instead of a traceback,
as ``deltaserve serve`` does. Torch-free.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

from deltaserve.engine.config import EngineConfig, parse_override
from deltaserve.engine.errors import ConfigError

T = TypeVar("T")

#: the exit status of a tool whose configuration is invalid (argparse's for a usage error)
CONFIG_ERROR_EXIT = 2


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="engine config (TOML, JSON or YAML)")
    parser.add_argument(
        "--set",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override a config value, e.g. --set scheduler.policy=lpm (repeatable)",
    )


def config_from_args(args: argparse.Namespace, base: dict[str, object] | None = None) -> EngineConfig:
    """The config named by ``--config``, with ``base`` defaults under ``--set`` overrides."""
    overrides: dict[str, object] = dict(base or {})
    for item in args.set:
        key, value = parse_override(item)
        overrides[key] = value
    return EngineConfig.load(args.config, overrides)


def run_tool(main: Callable[[], T], prog: str) -> T:
    """Run a tool's ``main``; a ``ConfigError`` (from its flags, its config file or the engine it
    starts) prints ``prog: message`` on stderr and exits ``CONFIG_ERROR_EXIT``. Anything else
    propagates unchanged: a traceback there is a bug to see, not a user's value to fix."""
    try:
        return main()
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
