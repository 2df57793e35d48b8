"""Byte sizes with units in every size key (file, ``--set``, constructor), and config errors as one
line naming the key, the value and the limit: from the library, from ``deltaserve serve`` (printed
once, not once per process) and from the tools (no traceback, exit status 2)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from deltaserve.engine.byte_size import bytes_arg, format_bytes, parse_bytes, size_fields
from deltaserve.engine.config import CacheConfig, ConfigError, EngineConfig, parse_override
from deltaserve.engine.core.sizing import ModelShape, plan_capacity
from deltaserve.server.config import ServerConfig
from tests.serve_procs import SERVE

REPO = Path(__file__).resolve().parents[2]
KiB, MiB, GiB = 2**10, 2**20, 2**30

#: every byte-size key of [cache]: a new one must be typed PosBytes / NonNegBytes to be listed
CACHE_SIZE_KEYS = {
    "memory_bytes", "kv_cache_bytes", "checkpoint_pool_bytes", "checkpoint_staging_bytes",
    "host_kv_cache_bytes", "host_checkpoint_pool_bytes", "host_memory_bytes", "host_load_bytes_per_step",
    "disk_bytes", "disk_write_bytes_per_s", "disk_read_buffer_bytes",
    "remote_segment_bytes", "remote_buffer_bytes", "remote_write_bytes_per_s",
}  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("2Ki", 2 * KiB),
        ("512MB", 512 * 10**6),
        ("4GB", 4 * 10**9),
        ("1kB", 1000),
        ("1KB", 1000),
        ("4gb", 4 * 10**9),
        ("4G", 4 * GiB),  # a bare upper-case letter is binary (vLLM's human_readable_int)
        ("100K", 100 * KiB),
        ("100k", 100_000),  # lower case decimal
        ("2m", 2 * 10**6),
        ("1T", 2**40),
        ("7", 7),
        ("7B", 7),
        (" 3 MiB ", 3 * MiB),
        ("1.1KiB", 1126),  # rounded down to whole bytes
        (4096, 4096),
        (0, 0),
    ],
)
def test_sizes_parse(text: object, expected: int) -> None:
    assert parse_bytes(text, "cache.memory_bytes") == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("4XB", "not a size"),
        ("-1GiB", "a size cannot be negative"),
        ("abc", "not a size"),
        ("", "not a size"),
        ("GiB", "not a size"),
        ("4 GiBs", "not a size"),
        (True, "not a size"),
        (1.5, "not a size"),
        (-3, "a size cannot be negative"),
    ],
)
def test_bad_sizes_name_the_key_and_the_value(value: object, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_bytes(value, "cache.disk_bytes")
    assert str(e.value).startswith(f"cache.disk_bytes = {value!r}: {why}")
    assert "\n" not in str(e.value)


def test_each_section_knows_its_key_so_errors_name_it() -> None:
    for f in msgspec.structs.fields(EngineConfig):
        assert f.type.section_key == f.name
    with pytest.raises(ConfigError, match=r"^scheduler\.max_num_seqs = 0: "):
        EngineConfig.from_dict({"scheduler": {"max_num_seqs": 0}})


def test_sizes_print_in_the_unit_that_shows_them() -> None:
    assert [format_bytes(n) for n in (256 * MiB, 16 * GiB, 917504, 1331, 7)] == [
        "256MiB", "16GiB", "896KiB", "1.3KiB", "7B",
    ]  # fmt: skip


def test_a_tool_flag_takes_units() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-bytes", type=bytes_arg)
    assert parser.parse_args(["--cache-bytes", "1.5GiB"]).cache_bytes == 3 * GiB // 2
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'4XB': not a size"):
        bytes_arg("4XB")


def test_every_cache_size_key_is_a_size() -> None:
    assert size_fields(CacheConfig) == CACHE_SIZE_KEYS


@pytest.mark.parametrize("key", sorted(CACHE_SIZE_KEYS))
def test_each_size_key_takes_units_in_toml_set_and_constructor(key: str, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'[cache]\n{key} = "3MiB"\n', encoding="utf-8")
    assert getattr(EngineConfig.load(path).cache, key) == 3 * MiB
    assert getattr(EngineConfig.load(None, dict([parse_override(f"cache.{key}=3MiB")])).cache, key) == 3 * MiB
    assert getattr(CacheConfig(**{key: "3MiB"}), key) == 3 * MiB
    assert getattr(EngineConfig().replace(**{f"cache.{key}": "2GB"}).cache, key) == 2 * 10**9
    for bad in ("4XB", "-1GiB"):
        path.write_text(f'[cache]\n{key} = "{bad}"\n', encoding="utf-8")
        with pytest.raises(ConfigError, match=rf"^cache\.{key} = '{bad}': "):
            EngineConfig.load(path)
        with pytest.raises(ConfigError, match=rf"^cache\.{key} = '{bad}': "):
            CacheConfig(**{key: bad})


def test_a_size_below_its_range_names_the_limit() -> None:
    with pytest.raises(ConfigError, match=r"^cache\.disk_bytes = 0: Expected `int` >= 1$"):
        EngineConfig.load(None, {"cache.disk_bytes": "0GiB"})
    with pytest.raises(ConfigError, match=r"^cache\.disk_bytes = 0: Expected `int` >= 1$"):
        CacheConfig(disk_bytes="0KiB")


def test_server_body_limit_takes_units() -> None:
    assert ServerConfig(max_body_bytes="4MiB").max_body_bytes == 4 * MiB
    with pytest.raises(ConfigError, match=r"^server\.max_body_bytes = '4XB': not a size"):
        ServerConfig(max_body_bytes="4XB")


SHAPE = ModelShape(kv_bytes_per_token=2048, state_bytes=458752, max_position_embeddings=8192)


def test_a_cache_budget_too_small_names_the_key_and_the_exact_minimum() -> None:
    low = EngineConfig.load(None, {"cache.memory_bytes": 1})
    with pytest.raises(ConfigError) as e:
        plan_capacity(low, SHAPE)
    message = str(e.value)
    assert message.startswith("cache.memory_bytes = 1 is below the minimum 896KiB (917504 bytes) needed for")
    minimum = int(message.split("(")[1].split()[0])
    plan_capacity(EngineConfig.load(None, {"cache.memory_bytes": minimum}), SHAPE)  # the minimum runs
    with pytest.raises(ConfigError, match="below the minimum"):
        plan_capacity(EngineConfig.load(None, {"cache.memory_bytes": minimum - 1}), SHAPE)


def test_a_cuda_budget_too_small_names_gpu_memory_utilization() -> None:
    with pytest.raises(
        ConfigError, match=r"^cache\.gpu_memory_utilization = 0\.9: the cache budget it leaves"
    ):
        plan_capacity(EngineConfig(), SHAPE, budget_bytes=1000)


def test_a_fixed_split_too_small_names_its_key() -> None:
    kv = EngineConfig.load(None, {"cache.kv_cache_bytes": 100})
    with pytest.raises(ConfigError, match=r"^cache\.kv_cache_bytes = 100 is below the minimum 32KiB"):
        plan_capacity(kv, SHAPE)
    dense = ModelShape(kv_bytes_per_token=4096, state_bytes=0, max_position_embeddings=64)
    fixed = EngineConfig.load(None, {"cache.memory_bytes": "1KiB"})
    with pytest.raises(ConfigError) as e:
        plan_capacity(fixed, dense)
    minimum = int(str(e.value).split("(")[1].split()[0])
    assert str(e.value).startswith("cache.memory_bytes = 1024 is below the minimum")
    plan_capacity(EngineConfig.load(None, {"cache.memory_bytes": minimum}), dense)


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def test_serve_prints_a_too_small_budget_once_on_one_line() -> None:
    """The default placement (a separate core process) used to log the error in the core and print
    it in the front end: two lines, neither naming the key nor the minimum."""
    run = _run(*SERVE, "--port", "0", "--set", "cache.memory_bytes=1")
    assert run.returncode == 2, run.stderr
    mentions = [line for line in run.stderr.splitlines() if "memory_bytes" in line or "ERROR" in line]
    assert len(mentions) == 1, run.stderr
    assert "Traceback" not in run.stderr
    (line,) = mentions
    assert line.startswith("deltaserve")
    assert (
        ": cache.memory_bytes = 1 is below the minimum 896KiB (917504 bytes) needed for one live GDN" in line
    )
    quiet = _run(*SERVE, "--port", "0", "--set", "logging.level=warning", "--set", "cache.memory_bytes=1")
    assert quiet.returncode == 2 and quiet.stderr.strip().splitlines() == [line], quiet.stderr


def test_tools_print_a_config_error_as_one_line_and_exit_2() -> None:
    run = _run(
        sys.executable, "tools/loadgen.py", "--set", "logging.level=warning", "--set", "cache.memory_bytes=1"
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        line
        for line in run.stderr.splitlines()
        if line.startswith("loadgen: cache.memory_bytes = 1 is below")
    ], run.stderr
    assert run.stdout == ""
    sim = _run(sys.executable, "tools/simulate_cache.py", "--set", "cache.disk_bytes=4XB")
    assert sim.returncode == 2
    assert sim.stderr.strip().splitlines() == [
        "simulate_cache: cache.disk_bytes = '4XB': not a size; expected an integer, or a number with a unit: "
        "4GiB, 512MiB (binary), 4GB, 512MB (decimal), 4G (= 4GiB)"
    ]
