"""Our rope against transformers' rotary embeddings.

Qwen3.5's text rope is multimodal (mrope: T/H/W sections interleaved over the frequencies);
for text-only input transformers feeds identical T/H/W positions, and then it must equal the
plain partial rope we implement.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from deltaserve.models.rope import RotaryEmbedding, apply_rotary

POSITIONS = torch.tensor([0, 1, 2, 63, 64, 65, 1000, 8191])


@pytest.mark.parametrize("mrope_section", [[11, 11, 10], [2, 1, 1]])
def test_qwen35_mrope_reduces_to_partial_rope_for_text(mrope_section: list[int]) -> None:
    head_dim = 4 * sum(mrope_section) * 2  # rotary dim = 2 * sum(section) at factor 0.25
    config = transformers.Qwen3_5TextConfig(
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
        },
    )
    hf_cos, hf_sin = Qwen3_5TextRotaryEmbedding(config)(
        torch.zeros(1), POSITIONS.view(1, 1, -1).expand(3, 1, -1)
    )
    rope = RotaryEmbedding.from_config(config, head_dim)
    cos, sin = rope.cos_sin(POSITIONS, torch.float32)
    assert rope.rotary_dim == head_dim // 4
    torch.testing.assert_close(cos, hf_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=0, rtol=0)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 1_000_000.0},
        {
            "rope_type": "yarn",
            "rope_theta": 1_000_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
        },
        {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0},
    ],
)
def test_qwen3_rope_matches_transformers(rope_parameters: dict) -> None:
    config = transformers.Qwen3Config(
        head_dim=64, max_position_embeddings=8192, rope_parameters=rope_parameters
    )
    hf_cos, hf_sin = Qwen3RotaryEmbedding(config)(torch.zeros(1), POSITIONS.view(1, -1))
    cos, sin = RotaryEmbedding.from_config(config, 64).cos_sin(POSITIONS, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=1e-6)


def test_dynamic_rope_is_rejected() -> None:
    config = transformers.Qwen3Config(
        head_dim=64, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    )
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        RotaryEmbedding.from_config(config, 64)


def test_partial_rotation_leaves_tail_untouched() -> None:
    x = torch.randn(len(POSITIONS), 3, 32, generator=torch.Generator().manual_seed(0))
    rope = RotaryEmbedding.from_config(
        transformers.Qwen3_5TextConfig(
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        ),
        32,
    )
    y = apply_rotary(x, *rope.cos_sin(POSITIONS, x.dtype))
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert torch.equal(y[0], x[0])  # position 0: identity
    torch.testing.assert_close(y[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1))  # a rotation
