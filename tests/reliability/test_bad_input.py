"""Bad input at ``generate`` and in the config: a typed error naming the field, raised at the
call, and no other request is affected."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from deltaserve.engine import (
    ConfigError,
    EngineCore,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
    SamplingParams,
)
from deltaserve.engine.config import CacheConfig, EngineConfig, LoggingConfig, ModelConfig, SchedulerConfig
from tests.engine.conftest import greedy, make_config
from tests.reliability.conftest import tokens

OK = tokens(20, 1)

# (prompt, keyword arguments of generate) -> (exception type, message regex)
BAD_REQUESTS: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
    (OK, {"cache_salt": 5}, InvalidRequestError, r"cache_salt must be a non-empty str .* got 5"),
    (OK, {"cache_salt": b"x"}, InvalidRequestError, r"cache_salt must be a non-empty str .* got b'x'"),
    (OK, {"cache_salt": ["a"]}, InvalidRequestError, r"cache_salt must be a non-empty str"),
    (OK, {"cache_salt": ""}, InvalidRequestError, r"cache_salt must be a non-empty str"),
    (OK, {"cache_salt": "t\ud800"}, InvalidRequestError, r"cache_salt is not valid Unicode text"),
    (OK, {"cache_salt": "x" * 5000}, InvalidRequestError, r"cache_salt must be .* at most 1024 characters"),
    (OK, {"request_id": ""}, InvalidRequestError, r"request_id must be a non-empty str"),
    (OK, {"request_id": 7}, InvalidRequestError, r"request_id must be a non-empty str"),
    (OK, {"request_id": "r\udfff"}, InvalidRequestError, r"request_id is not valid Unicode text"),
    (OK, {"priority": "1"}, InvalidRequestError, r"priority must be an int"),
    (OK, {"priority": 1.5}, InvalidRequestError, r"priority must be an int"),
    (OK, {"priority": True}, InvalidRequestError, r"priority must be an int"),
    (
        OK,
        {"priority": 10**400},
        InvalidRequestError,
        r"priority must be an int in .* got <int of 401 digits>",
    ),
    (
        OK,
        {"sampling_params": {"max_tokens": 3}},
        InvalidRequestError,
        r"sampling_params must be SamplingParams",
    ),
    (
        OK,
        {"sampling_params": SamplingParams(stop_token_ids=[10**6])},
        InvalidRequestError,
        r"stop token id 1000000",
    ),
    ("a\ud800b", {}, InvalidRequestError, r"prompt is not valid Unicode text"),
    ("", {}, InvalidRequestError, r"prompt is empty"),
    (
        123,
        {},
        InvalidRequestError,
        r"prompt must be a str, a list of token ids or a list of chat messages, got int",
    ),
    ([], {}, InvalidRequestError, r"prompt is empty"),
    ([1, "a"], {}, InvalidRequestError, r"prompt token 1 is 'a', not an int"),
    ([True], {}, InvalidRequestError, r"prompt token 0 is True, not an int"),
    ([10**9], {}, InvalidRequestError, r"prompt token 0 = 1000000000 is outside the vocabulary"),
    ([-1], {}, InvalidRequestError, r"prompt token 0 = -1 is outside the vocabulary"),
    ([{"role": "user"}], {}, InvalidRequestError, r"message 0 must have string 'role' and 'content'"),
    (
        [{"role": "user", "content": "\udc80"}],
        {},
        InvalidRequestError,
        r"message 0 content is not valid Unicode",
    ),
    ([{"role": "user", "content": 5}], {}, InvalidRequestError, r"message 0 must have string"),
    ([7] * 9000, {}, PromptTooLongError, r"prompt has 9000 tokens; max_model_len is 8192"),
    ("word " * 9000, {}, PromptTooLongError, r"prompt has \d+ tokens; max_model_len is 8192"),
]


async def test_bad_requests_are_refused_and_nothing_else_is_affected(engine_factory: Any) -> None:
    async with engine_factory() as engine:
        # a request in flight the whole time
        bystander = engine.generate(tokens(30, 9), greedy(40))
        first = await asyncio.wait_for(bystander.__anext__(), 60)
        tried = 0
        for prompt, kwargs, exc, message in BAD_REQUESTS:
            params = kwargs.pop("sampling_params", greedy(3))
            with pytest.raises(exc, match=message):
                engine.generate(prompt, params, **kwargs)
            tried += 1
        assert tried == len(BAD_REQUESTS)
        outs = [first]
        while not outs[-1].finished:
            outs.append(await asyncio.wait_for(bystander.__anext__(), 60))
        assert outs[-1].finish_reason == "length"
        assert sum(len(o.token_ids) for o in outs) == 40
        assert engine.is_healthy()
        await engine.check_integrity()
        stats = engine.stats()
        assert stats["requests.failed"] == 0 and stats["live_slots.used"] == 0


def test_overload_is_typed(core_factory: Any) -> None:
    core: EngineCore = core_factory(**{"scheduler.max_waiting": 1})
    core.add_request(core.make_request(OK, greedy(2)))
    with pytest.raises(
        EngineOverloadedError, match=r"waiting queue is full \(1 >= scheduler.max_waiting = 1\)"
    ):
        core.check_capacity()


# ---------------------------------------------------------------------- config
BAD_CONFIGS: list[tuple[Any, str]] = [
    (lambda: SchedulerConfig(max_num_seqs=0), r"scheduler.max_num_seqs = 0: Expected `int` >= 1"),
    (lambda: CacheConfig(block_size=0), r"cache.block_size = 0: Expected `int` >= 1"),
    (lambda: CacheConfig(num_kv_blocks=-1), r"cache.num_kv_blocks = -1: Expected `int` >= 1"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), r"cache.gpu_memory_utilization = 1.5"),
    (
        lambda: ModelConfig(dtype="float64"),
        r"model.dtype = 'float64': expected one of float32, bfloat16, float16, auto",
    ),
    (lambda: ModelConfig(device="tpu"), r"model.device = 'tpu': expected auto, cpu, cuda or cuda:N"),
    (lambda: ModelConfig(seed=2**64), r"model.seed = 18446744073709551616"),
    (lambda: LoggingConfig(stats_interval_s=math.nan), r"logging.stats_interval_s = nan"),
    (lambda: LoggingConfig(level="loud"), r"logging.level = 'loud': expected one of debug, info"),
    (
        lambda: EngineConfig(cache={"block_size": 3}),
        r"cache = \{.block_size.: 3\}: expected a CacheConfig, got a dict",
    ),
    (
        lambda: EngineConfig.load(None, {"logging.stats_interval_s": math.nan}),
        r"logging.stats_interval_s = nan",
    ),
    (
        lambda: EngineConfig.load(
            None, {"scheduler.policy": "priority", "scheduler.policy_options": {"aging_steps": 0}}
        ),
        r"scheduler.policy_options = \{'aging_steps': 0\}: ValueError",
    ),  # fmt: skip
    (
        lambda: EngineConfig.load(None, {"scheduler.policy_options": {"x": 1}}),
        r"scheduler.policy_options = \{'x': 1\}",
    ),
    (
        lambda: EngineConfig.load(None, {"scheduler.policy": "no.such.module:Cls"}),
        r"scheduler.policy = 'no.such",
    ),
]


@pytest.mark.parametrize(("build", "message"), BAD_CONFIGS)
def test_bad_config_values_raise_config_error(build: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_unreadable_config_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'[model]\npath = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match=r"bad.toml: not valid UTF-8"):
        EngineConfig.load(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ConfigError, match=r"broken.json: "):
        EngineConfig.load(broken)
    with pytest.raises(ConfigError, match=r"config file not found"):
        EngineConfig.load(tmp_path / "missing.toml")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_device_and_backend_that_cannot_run_here_are_config_errors(
    tiny_loaded: Any, monkeypatch: Any
) -> None:
    with pytest.raises(ConfigError, match=r"model.device = 'cuda': CUDA is not available"):
        EngineCore(make_config(**{"model.device": "cuda"}), loaded=tiny_loaded)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"kernels.backend = 'triton': .*TRITON_INTERPRET=1"):
        EngineCore(make_config(**{"kernels.backend": "triton"}), loaded=tiny_loaded)
