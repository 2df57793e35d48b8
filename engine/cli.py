"""Command-line plumbing shared by every tool: ``--config FILE`` and ``--set section.key=value``."""

from __future__ import annotations

import argparse

from deltaserve.engine.config import EngineConfig, parse_override


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
