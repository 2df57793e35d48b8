"""Counting hooks for the validate-once test (``tests/engine/test_validate_once.py``): in the
front end's process the test patches directly; a separate core process calls ``count_in_core``
through ``DELTASERVE_CORE_HOOK`` (``engine/core/core_proc.py``) and appends one line per
``SamplingParams`` validation ("params") and per admission check ("capacity") to the file that
``DELTASERVE_TEST_COUNT_FILE`` names."""

from __future__ import annotations

import os
from typing import Any

from deltaserve.engine import sampling_params

COUNT_ENV = "DELTASERVE_TEST_COUNT_FILE"


def counting_rules(seen: list[str]) -> tuple[Any, ...]:
    """``SamplingParams``' rules with a first one that records each validation in ``seen``."""

    def count(value: object, params: object) -> bool:
        seen.append("params")
        return True

    return (("n", count, "never fails"), *sampling_params._RULES)


class _FileLog(list[str]):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def append(self, item: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(item + "\n")


def count_in_core(server: Any) -> None:
    """Record the core process's validations and admission checks in the count file."""
    log = _FileLog(os.environ[COUNT_ENV])
    sampling_params._RULES = counting_rules(log)  # type: ignore[assignment]
    core = server.core
    real = core.check_capacity

    def check_capacity(pending: int = 0) -> None:
        log.append("capacity")
        real(pending)

    core.check_capacity = check_capacity
