"""The ``[speculative]`` section's errors, and the drafters on their own."""

from __future__ import annotations

import numpy as np
import pytest

from deltaserve.engine.config import EngineConfig, SpeculativeConfig
from deltaserve.engine.errors import ConfigError
from deltaserve.engine.spec.ngram import lookup
from deltaserve.engine.spec.replay import ReplayDrafter
from deltaserve.engine.spec.stats import SpecStats
from deltaserve.scheduler.request import Request


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"speculative": {"method": "eagle"}}, "speculative.method = 'eagle': expected one of none, ngram, replay, mtp"),
        ({"speculative": {"num_tokens": 0}}, "speculative.num_tokens = 0: Expected `int` >= 1"),
        ({"speculative": {"num_tokens": 17}}, "speculative.num_tokens = 17: Expected `int` <= 16"),
        ({"speculative": {"prompt_lookup_min": 5}},
         "speculative.prompt_lookup_min = 5: must be <= speculative.prompt_lookup_max (4)"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key_and_value(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_dict(data)
    assert str(e.value) == message


def test_the_section_checks_itself_when_built_in_code() -> None:
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    assert str(e.value) == "speculative.prompt_lookup_min = 3: must be <= speculative.prompt_lookup_max (2)"
    assert not SpeculativeConfig().enabled and EngineConfig().speculative.method.value == "none"


def test_ngram_takes_the_longest_suffix_and_its_most_recent_occurrence() -> None:
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3, 6, 4, 1, 2, 3])
    # suffix [1, 2, 3] occurred at 0 and 4: the most recent (4) is followed by 7, 8, 5
    assert lookup(t, 3, 2, 3) == [7, 8, 5]
    # only the 2-token suffix [2, 3] is tried: its most recent occurrence (10) is followed by 6, 4
    assert lookup(t, 2, 2, 2) == [6, 4]
    assert lookup(np.array([1, 2, 3, 4]), 3, 1, 3) == []  # nothing repeats
    assert lookup(np.array([5, 6, 5, 6]), 3, 2, 2) == [5, 6]  # cut at the context's end


def test_replay_proposes_while_the_output_agrees_and_corrupts_every_other() -> None:
    d = ReplayDrafter(vocab_size=100, corrupt_every=0)
    d.record([1, 2, 3], [10, 11, 12, 13, 14])
    req = Request("a", [1, 2, 3], sampling_params=None)
    assert d.propose(req, 3) == []  # nothing sampled yet: the first token is the model's
    req.append_token(10)
    assert d.propose(req, 3) == [11, 12, 13]
    req.append_token(99)  # diverged from the recording
    assert d.propose(req, 3) == []
    c = ReplayDrafter(vocab_size=100, corrupt_every=2)
    c.record([1, 2, 3], [10, 11, 12, 13, 14])
    req = Request("b", [1, 2, 3], sampling_params=None)
    req.append_token(10)
    assert c.propose(req, 3) == [12, 12, 14]  # output positions 1 and 3 are off by one


def test_stats_count_windows_tokens_and_positions() -> None:
    s = SpecStats(3)
    s.observe(3, 3)
    s.observe(3, 1)
    s.observe(2, 0)
    out = s.stats()
    assert (out["spec_decode.num_drafts"], out["spec_decode.num_draft_tokens"]) == (3, 8)
    assert out["spec_decode.num_accepted_tokens"] == 4 and out["spec_decode.num_emitted_tokens"] == 7
    assert [out[f"spec_decode.num_accepted_tokens_per_pos.{i}"] for i in range(3)] == [2, 1, 1]
    assert out["spec_decode.acceptance_rate"] == 0.5
