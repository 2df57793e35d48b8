"""Host memory (engine/runner/memory.py, the capacity line's resident part in engine/core/sizing.py): the
resident-set reader, the allocator settings and their effect, idle release, expected RSS."""

from __future__ import annotations

import ctypes.util
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from deltaserve.engine import EngineConfig, EngineCore
from deltaserve.engine.core.builder import SMALL_MODEL_BYTES, cpu_threads, default_cpu_threads
from deltaserve.engine.core.sizing import (
    ACTIVATION_WIDTHS,
    FIXED_OVERHEAD_BYTES,
    LOGITS_COPIES,
    ModelShape,
    plan_capacity,
    workspace_bytes,
)
from deltaserve.engine.runner.memory import Releaser, parse_status, resident
from deltaserve.models import LoadedModel
from tests.engine.conftest import greedy, run_to_completion

MiB = 1024**2
LINUX = Path("/proc/self/status").is_file()
GLIBC = (
    LINUX and ctypes.util.find_library("c") is not None and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
)

STATUS = """Name:\tpython
VmPeak:\t 9000000 kB
VmHWM:\t 7700000 kB
VmRSS:\t 7600000 kB
RssAnon:\t 7400000 kB
RssFile:\t  190000 kB
RssShmem:\t      10 kB
Threads:\t5
"""


def test_parse_status_reads_kilobytes_as_bytes() -> None:
    r = parse_status(STATUS)
    assert (r.total, r.anon, r.file, r.peak) == (
        7600000 * 1024,
        7400000 * 1024,
        190000 * 1024,
        7700000 * 1024,
    )
    assert r.mib()["rss_mib"] == round(7600000 / 1024, 1)


def test_parse_status_without_the_split_fields_and_without_vmrss() -> None:
    r = parse_status("VmRSS:\t 2048 kB\n")  # kernels before 4.5 have no RssAnon/RssFile
    assert (r.total, r.anon, r.file, r.peak) == (2 * MiB, 0, 0, 2 * MiB)
    with pytest.raises(ValueError, match="no VmRSS line"):
        parse_status("Name:\tpython\n")


@pytest.mark.skipif(not LINUX, reason="/proc/self/status is Linux's")
def test_resident_grows_with_touched_memory() -> None:
    before = resident()
    assert before is not None and before.anon + before.file <= before.total + MiB
    # fresh pages from the kernel (a heap allocation may reuse pages already resident: the
    # engine's allocator settings keep freed blocks), each one touched
    block = mmap.mmap(-1, 64 * MiB)
    block.write(b"\x01" * (64 * MiB))
    after = resident()
    assert after is not None and after.total - before.total >= 48 * MiB
    block.close()


# The allocator scenario: a freed 16 MiB buffer (glibc then raises its mmap threshold to 16 MiB),
# then 48 buffers of 4 MiB, each followed by a 64 KiB long-lived one, all touched; the big ones
# are freed. The heap holes left stay resident (glibc's default) until malloc_trim returns them.
# Prints the resident growth in MiB.
SCENARIO = textwrap.dedent(
    """
    import ctypes, sys
    from deltaserve.engine.runner import memory
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    MiB = 1 << 20
    libc.free(libc.malloc(16 * MiB))
    base = memory.resident().total
    big, small = [], []
    for _ in range(48):
        p = libc.malloc(4 * MiB)
        ctypes.memset(p, 1, 4 * MiB)
        big.append(p)
        small.append(libc.malloc(64 * 1024))  # above tcache sizes: lands between
    for p in big:
        libc.free(p)
    if sys.argv[1] == "trimmed":
        assert memory.release()
    print((memory.resident().total - base) / MiB)
    """
)


def _grown_mib(mode: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this deltaserve
    out = subprocess.run(
        [sys.executable, "-c", SCENARIO, mode],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_freed_buffers_stay_resident_until_a_release() -> None:
    kept = _grown_mib("default")
    assert kept >= 150, kept  # glibc's dynamic threshold keeps the 192 MiB of holes
    assert _grown_mib("trimmed") < 16


def test_releaser_releases_once_per_idle_after_work() -> None:
    on = Releaser(enabled=True)
    assert on.idle() is False  # nothing ran yet
    on.worked()
    on.worked()
    assert on.idle() is GLIBC and on.releases == int(GLIBC)
    assert on.idle() is False and on.releases == int(GLIBC)  # still idle: nothing new to give back
    off = Releaser(enabled=False)
    off.worked()
    assert off.idle() is False and off.releases == 0


@pytest.mark.skipif(not LINUX, reason="/proc/self/maps is Linux's")
def test_loaded_weights_do_not_map_the_checkpoint(tiny_loaded: LoadedModel) -> None:
    """The weights are read into memory of their own: no safetensors file stays mapped (a map
    would stay resident beside the fused copies made of its tensors)."""
    files = sorted(Path(tiny_loaded.path).glob("*.safetensors"))
    assert files
    maps = Path("/proc/self/maps").read_text()
    assert not [f for f in files if str(f.resolve()) in maps]


SHAPE = ModelShape(
    kv_bytes_per_token=6 * 2 * 2 * 256 * 4,
    state_bytes=18 * (6144 * 3 * 4 + 16 * 128 * 128 * 4),
    max_position_embeddings=262144,
    weight_bytes=2870 * MiB,
    widest_features=8224,
    vocab_size=248320,
)


def test_expected_resident_is_weights_pools_workspace_and_overhead() -> None:
    config = EngineConfig.load(None, {"cache.memory_bytes": 4096 * MiB})
    cap = plan_capacity(config, SHAPE)
    work = 2048 * ACTIVATION_WIDTHS * 8224 * 4 + 64 * LOGITS_COPIES * 248320 * 4
    assert cap.workspace_bytes == work == workspace_bytes(config, SHAPE)
    assert cap.pool_bytes == cap.arena_bytes <= 4096 * MiB
    assert cap.expected_resident_bytes == 2870 * MiB + cap.arena_bytes + work + FIXED_OVERHEAD_BYTES
    line = cap.describe()
    assert line["expected_rss_mib"] == round(cap.expected_resident_bytes / MiB, 1)
    assert (line["weights_mib"], line["overhead_mib"]) == (2870.0, FIXED_OVERHEAD_BYTES / MiB)
    # the workspace follows the step's token budget
    smaller = plan_capacity(EngineConfig.load(None, {"scheduler.max_num_batched_tokens": 512}), SHAPE)
    assert smaller.workspace_bytes == 512 * ACTIVATION_WIDTHS * 8224 * 4 + 64 * LOGITS_COPIES * 248320 * 4


def test_fixed_pools_and_host_tier_count_in_the_expected_resident() -> None:
    config = EngineConfig.load(
        None,
        {
            "cache.memory_bytes": 1024 * MiB,
            "cache.checkpoint_fraction": 0.3,
            "cache.host_memory_bytes": 512 * MiB,
        },
    )
    cap = plan_capacity(config, SHAPE)
    assert not cap.shared and cap.num_host_pages > 0
    assert cap.pool_bytes == cap.kv_bytes + cap.live_bytes + cap.checkpoint_bytes
    assert 0 < cap.host_tier_bytes <= 512 * MiB
    assert cap.expected_resident_bytes == (
        SHAPE.weight_bytes + cap.pool_bytes + cap.host_tier_bytes + cap.workspace_bytes + FIXED_OVERHEAD_BYTES
    )


def test_no_resident_line_without_the_weights() -> None:
    """The simulator (and a CUDA engine) plans no host memory: no weights, no line."""
    bare = ModelShape(
        kv_bytes_per_token=SHAPE.kv_bytes_per_token,
        state_bytes=SHAPE.state_bytes,
        max_position_embeddings=4096,
    )
    cap = plan_capacity(EngineConfig(), bare)
    assert cap.expected_resident_bytes == 0 and cap.workspace_bytes == 0 and cap.overhead_bytes == 0
    assert not {"expected_rss_mib", "weights_mib", "workspace_mib", "overhead_mib"} & set(cap.describe())


@pytest.mark.skipif(not LINUX, reason="/proc/self/status is Linux's")
def test_engine_states_its_resident_memory_and_keeps_to_it(core_factory: Callable[..., EngineCore]) -> None:
    before = resident()
    core = core_factory()
    built = resident()
    model = core.loaded.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    cap = core.capacity
    assert cap.weight_bytes == weights  # the tied lm_head counted once
    assert core.model_info.capacity["expected_rss_mib"] == round(cap.expected_resident_bytes / MiB, 1)
    for i in range(4):
        core.add_request(core.make_request(list(range(3, 3 + 200 + 17 * i)), greedy(8)))
    run_to_completion(core)
    assert core.releaser.releases == int(GLIBC)  # one release at the end of the work
    after = resident()
    assert before is not None and built is not None and after is not None
    # private memory: building takes the pools (the fixture loaded the weights); running, at
    # most the workspace. (Library code pages mapped on first use are the fixed overhead's;
    # the test process's other memory is not the engine's to bound.)
    assert built.anon - before.anon <= cap.pool_bytes + 32 * MiB
    assert after.anon - built.anon <= cap.workspace_bytes


def test_release_memory_off_keeps_the_allocator_as_it_is(core_factory: Callable[..., EngineCore]) -> None:
    core = core_factory(**{"engine.release_memory": False})
    core.add_request(core.make_request(list(range(3, 40)), greedy(4)))
    run_to_completion(core)
    assert core.releaser.releases == 0


def test_cpu_threads_default_to_the_environment_then_the_model_size() -> None:
    big = SMALL_MODEL_BYTES
    before = torch.get_num_threads()
    try:
        config = EngineConfig.load(None, {"engine.cpu_threads": 3})
        assert cpu_threads(config, torch.device("cpu"), 0) == 3 == torch.get_num_threads()
        auto = cpu_threads(EngineConfig(), torch.device("cpu"), big)
        assert auto == default_cpu_threads(os.environ, big) == torch.get_num_threads()
        assert cpu_threads(EngineConfig(), torch.device("cuda"), big) is None  # not ours to set there
    finally:
        torch.set_num_threads(before)
    every_cpu = len(os.sched_getaffinity(0))
    assert default_cpu_threads({}, big) == every_cpu
    assert default_cpu_threads({}, big - 1) == 1  # a tiny model's ops are too small to split
    assert default_cpu_threads({"OMP_NUM_THREADS": "1"}, big) == 1
    assert default_cpu_threads({"OMP_NUM_THREADS": " 7 "}, 0) == 7
    for junk in ("", "0", "-2", "two", "2,1"):
        assert default_cpu_threads({"OMP_NUM_THREADS": junk}, big) == every_cpu
