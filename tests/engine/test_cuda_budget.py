"""The cache budget on CUDA (``builder.cuda_cache_budget``), with the device's memory queries
replaced by fixed numbers so it runs anywhere: ``cache.memory_bytes`` set takes the place of the
``gpu_memory_utilization`` share once it fits in what the card has left; unset, the share minus
the weights, activations and other processes is the budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltaserve.engine import ConfigError, EngineConfig
from deltaserve.engine.core.builder import cuda_cache_budget

GiB = 1 << 30
TOTAL, FREE, RESERVED, PEAK = 80 * GiB, 70 * GiB, 6 * GiB, 5 * GiB  # others hold 80 - 70 - 6 = 4 GiB


@pytest.fixture
def card(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    probes: list[str] = []
    fake: dict[str, Any] = {
        "synchronize": lambda device=None: None,
        "mem_get_info": lambda device=None: (FREE, TOTAL),
        "reset_peak_memory_stats": lambda device=None: None,
        "max_memory_allocated": lambda device=None: PEAK,
        "memory_reserved": lambda device=None: RESERVED,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    return probes


def budget(card: list[str], **dotted: Any) -> int | None:
    return cuda_cache_budget(
        EngineConfig.load(None, dotted), lambda: card.append("probe"), torch.device("cuda")
    )


def test_the_utilization_share_minus_weights_activations_and_other_processes(card: list[str]) -> None:
    assert budget(card, **{"cache.gpu_memory_utilization": 0.5}) == 40 * GiB - PEAK - 4 * GiB
    assert card == ["probe"]  # the profiling forward ran once, between the two readings


def test_memory_bytes_takes_the_place_of_the_share_when_it_fits(card: list[str]) -> None:
    # 70 GiB fits in 80 - 5 - 4 = 71 GiB although the 0.5 share leaves only 31
    assert budget(card, **{"cache.memory_bytes": 70 * GiB, "cache.gpu_memory_utilization": 0.5}) is None


def test_memory_bytes_larger_than_the_card_has_left_is_a_config_error(card: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        budget(card, **{"cache.memory_bytes": 72 * GiB})
    assert str(e.value) == (
        "cache.memory_bytes = 72GiB: the device has 71GiB left of 80.0 GiB after the weights and "
        "activations (5.00 GiB) and other processes (4.00 GiB)"
    )


def test_a_share_below_the_weights_is_a_config_error(card: list[str]) -> None:
    with pytest.raises(
        ConfigError, match=r"^cache.gpu_memory_utilization = 0.1: 80.0 GiB device, weights \+ "
    ):
        budget(card, **{"cache.gpu_memory_utilization": 0.1})
