"""The multi-token-prediction head (``models/mtp.py``) against a plain-torch dense reference, its
loading from real-layout folders (built-ins, ``tools/make_shaped_model.py``), the load errors,
and the target's opt-in hidden-state output.

The reference below reads the ``mtp.*`` tensors straight from the safetensors files and runs
the head in float64 with dense causal attention over each sequence's whole list of head inputs
(no cache, no fusion, no kernels): every paged step's logits rows must match it under
tests/tolerances.py, and the greedy drafts it chains (its own hidden and argmax fed back) are
the ones the paged head chains.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltaserve.models import (
    LoadedModel,
    UnsupportedModelError,
    WeightMismatchError,
    load_model,
)
from deltaserve.models.builtin import MTP_WEIGHTS_FILE, mtp_checkpoint_tensors
from deltaserve.tools.make_shaped_model import SHAPES, write_shaped_model
from tests.models.conftest import EnvFactory
from tests.models.driver import PagedRunner, Seq, Work
from tests.models.test_parity import random_tokens
from tests.tolerances import assert_logits_close

# Qwen3.5-0.8B's layout (tied embeddings, one attention layer in four, partial rope) at test size.
SMALL_SHAPED = {
    **SHAPES["qwen3.5-0.8b"],
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_num_value_heads": 2,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 4096,
}


# Qwen3-Next's layout (fused GDN projections, MoE MLPs with a shared expert, per-expert tensors).
SMALL_SHAPED_NEXT = {
    **SMALL_SHAPED,
    "model_type": "qwen3_next",
    "tie_word_embeddings": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


@pytest.fixture(scope="session")
def shaped_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shaped_model(
        "qwen3.5-0.8b", tmp_path_factory.mktemp("shaped") / "n", "float32", SMALL_SHAPED_NEXT
    )


@pytest.fixture(scope="session")
def shaped_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shaped_model(
        "qwen3.5-0.8b", tmp_path_factory.mktemp("shaped") / "m", "float32", SMALL_SHAPED
    )


@pytest.fixture(scope="session")
def mtp_folders(builtin_paths: dict[str, Path], shaped_dir: Path, shaped_next_dir: Path) -> dict[str, Path]:
    return {"tiny-qwen3.5": builtin_paths["tiny-qwen3.5"], "tiny-qwen3-next": builtin_paths["tiny-qwen3-next"],
            "shaped-qwen3.5-tied": shaped_dir, "shaped-qwen3-next": shaped_next_dir}  # fmt: skip


def load(path: Path, envs: EnvFactory, **kwargs: Any) -> LoadedModel:
    return load_model(path, dtype=torch.float32, device="cpu", ops=envs.ops, **kwargs)


class DenseMtp:
    """The head in float64 from the folder's tensors: ``run(hid [n, H], tok [n])`` for
    positions ``0 .. n-1`` of one sequence -> (logits ``[n, V]``, hidden ``[n, H]``)."""

    def __init__(self, folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        self.cfg = cfg.get("text_config", cfg)
        self.w: dict[str, torch.Tensor] = {}
        for file in folder.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    self.w[key] = f.get_tensor(key).double()
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.w[f"{name}.weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * (1.0 + w)

    def lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.w[f"{name}.weight"].T

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        rope = self.cfg["rope_parameters"]
        d = x.shape[-1]
        r = int(d * rope.get("partial_rotary_factor", 1.0))
        inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
        ang = pos.double()[:, None] * inv[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)

    def attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        n, c = x.shape[0], self.cfg
        nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        qg = self.lin(x, f"{p}.q_proj").view(n, nh, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(n, nh * d)
        k = self.lin(x, f"{p}.k_proj").view(n, nkv, d)
        v = self.lin(x, f"{p}.v_proj").view(n, nkv, d)
        pos = torch.arange(n)
        q, k = self.rope(self.norm(q, f"{p}.q_norm"), pos), self.rope(self.norm(k, f"{p}.k_norm"), pos)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * d)
        return self.lin(o * torch.sigmoid(gate), f"{p}.o_proj")

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        if f"{p}.gate.weight" not in self.w:
            return self.lin(
                F.silu(self.lin(x, f"{p}.gate_proj")) * self.lin(x, f"{p}.up_proj"), f"{p}.down_proj"
            )
        probs = self.lin(x, f"{p}.gate").softmax(-1)
        top_w, top_i = probs.topk(self.cfg["num_experts_per_tok"], dim=-1)
        if self.cfg["norm_topk_prob"]:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for row in range(x.shape[0]):
            for weight, e in zip(top_w[row].tolist(), top_i[row].tolist(), strict=True):
                out[row] += weight * self.mlp(x[row : row + 1], f"{p}.experts.{e}")[0]
        if f"{p}.shared_expert_gate.weight" in self.w:
            shared = self.mlp(x, f"{p}.shared_expert")
            out = out + torch.sigmoid(self.lin(x, f"{p}.shared_expert_gate")) * shared
        return out

    def run(self, hid: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.norm(self.w["model.embed_tokens.weight"][tok], "mtp.pre_fc_norm_embedding")
        x = self.lin(torch.cat((emb, self.norm(hid.double(), "mtp.pre_fc_norm_hidden")), -1), "mtp.fc")
        x = x + self.attention(self.norm(x, "mtp.layers.0.input_layernorm"), "mtp.layers.0.self_attn")
        x = x + self.mlp(self.norm(x, "mtp.layers.0.post_attention_layernorm"), "mtp.layers.0.mlp")
        g = self.norm(x, "mtp.norm")
        return g @ self.lm_head.T, g


class Drafting:
    """Target + head on one paged cache, with the dense reference alongside: per sequence the
    head's input rows ``(hidden, token)`` by position, as the reference sees them."""

    def __init__(self, loaded: LoadedModel, ref: DenseMtp, envs: EnvFactory) -> None:
        self.model, self.ref = loaded.model, ref
        self.runner = PagedRunner(self.model, ops=envs.ops, with_mtp=True, kv_fill=float("nan"))
        # The same target steps without a head: the head must never touch the target's caches.
        self.plain = PagedRunner(self.model, ops=envs.ops, kv_fill=float("nan"))
        self.twin: dict[int, Seq] = {}
        self.rows: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self.head_out: dict[tuple[int, int], torch.Tensor] = {}  # (seq, pos) -> the paged head's g
        self.ref_out: dict[tuple[int, int], torch.Tensor] = {}  # (seq, pos) -> the reference's g

    def add(self, tokens: list[int]) -> Seq:
        seq = self.runner.add(tokens)
        self.twin[id(seq)] = self.plain.add(tokens)
        return seq

    def target(self, work: list[Work]) -> list[torch.Tensor]:
        """A target step; returns each item's post-norm hidden rows. Its logits must be the
        ones the same step gives on caches no head ever wrote."""
        batch, ordered = self.runner.build(work)
        logits, hidden = self.model.forward(batch, self.runner.caches, return_hidden=True)
        plain = self.plain.step([Work(self.twin[id(w.seq)], w.num_tokens) for w in work])
        for got, want in zip(PagedRunner.split(logits, batch, ordered, work), plain, strict=True):
            assert_logits_close(got, want, "target logits beside the head")
        for w in ordered:
            w.seq.num_computed += w.num_tokens
        return PagedRunner.split(hidden, batch, ordered, work)

    def head(self, items: list[tuple[Seq, int, list[int], torch.Tensor, bool]]) -> list[int]:
        """One head step: per item ``(seq, start, tokens, hidden rows, own)`` the rows at positions
        ``start ..`` (``own``: the hidden is this head's previous output, so the reference uses its
        own). Checks every row's logits against the reference; returns each item's greedy draft
        (the reference's argmax at its last row)."""
        saved = {id(s): s.num_computed for s, *_ in items}
        for s, start, *_ in items:
            s.num_computed = start
        work = [Work(s, len(toks)) for s, _, toks, _, _ in items]
        batch, ordered = self.runner.build(work, gdn_chunks=False)
        for s, *_ in items:
            s.num_computed = saved[id(s)]
        by_seq = {id(s): (start, toks, hid) for s, start, toks, hid, _ in items}
        ids = [t for w in ordered for t in by_seq[id(w.seq)][1]]
        hidden = torch.cat([by_seq[id(w.seq)][2] for w in ordered])
        out = self.model.mtp(
            dataclasses.replace(batch, input_ids=torch.tensor(ids)), hidden, self.runner.caches
        )
        assert out.logits.shape == (len(ids), self.ref.lm_head.shape[0]) and out.hidden.shape == hidden.shape
        drafts = []
        logits_rows = PagedRunner.split(out.logits, batch, ordered, work)
        hidden_rows = PagedRunner.split(out.hidden, batch, ordered, work)
        for (s, start, toks, hid, own), logits, g in zip(items, logits_rows, hidden_rows, strict=True):
            rows = self.rows.setdefault(id(s), [])
            del rows[start:]  # a re-run position replaces what was there (and drops what followed)
            for i, tok in enumerate(toks):
                rows.append((self.ref_out[(id(s), start - 1)] if own else hid[i].double(), tok))
                self.head_out[(id(s), start + i)] = g[i]
            ref_logits, ref_g = self.ref.run(
                torch.stack([h for h, _ in rows]), torch.tensor([t for _, t in rows])
            )
            for p in range(start, len(rows)):
                self.ref_out[(id(s), p)] = ref_g[p]
            assert_logits_close(logits, ref_logits[start:], f"head rows {start}..{len(rows) - 1}")
            # The drafted token: what the paged head proposes must be what the reference does.
            assert int(logits[-1].argmax()) == int(ref_logits[-1].argmax())
            drafts.append(int(ref_logits[-1].argmax()))
        return drafts

    def chain(self, s: Seq, pos: int, token: int) -> tuple[Seq, int, list[int], torch.Tensor, bool]:
        """The chained item at ``pos``: the head's own output at ``pos - 1`` and a drafted token."""
        return (s, pos, [token], self.head_out[(id(s), pos - 1)][None], True)


@pytest.mark.parametrize(
    "name", ["tiny-qwen3.5", "tiny-qwen3-next", "shaped-qwen3.5-tied", "shaped-qwen3-next"]
)
def test_paged_head_and_chained_drafts_match_dense_reference(
    name: str, mtp_folders: dict[str, Path], envs: EnvFactory
) -> None:
    folder = mtp_folders[name]
    d = Drafting(load(folder, envs, load_mtp=True), DenseMtp(folder), envs)
    a = d.add(random_tokens(90, seed=1))
    b = d.add(random_tokens(40, seed=2))
    # Prefill: the target's hidden at p with the token at p + 1 (a chunk's last row takes the
    # next prompt token; B's last takes its "sampled" token 23).
    ha, hb = d.target([Work(a, 64), Work(b, 23)])
    _, b1 = d.head([(a, 0, a.tokens[1:65], ha, False), (b, 0, b.tokens[1:24], hb, False)])
    # One batch mixing a chained draft (B at 23) and a prefill chunk's head rows (A 64..69,
    # whose last row takes A's "sampled" token 70 and drafts A's first token).
    (ha2,) = d.target([Work(a, 6)])
    a1, b2 = d.head([(a, 64, a.tokens[65:71], ha2, False), d.chain(b, 23, b1)])
    # Chained on: B has its k = 3 drafts, A its second.
    _, b3 = d.head([d.chain(a, 70, a1), d.chain(b, 24, b2)])
    # The target verifies B's window (one token at a time here: the verify batch is the
    # mechanism's); its hidden then replaces the drafts' rows at 23..25 and the chain restarts.
    hv = torch.cat([d.target([Work(b, 1)])[0] for _ in range(3)])
    (c1,) = d.head([(b, 23, b.tokens[24:27], hv, False)])
    d.head([d.chain(b, 26, c1)])


def test_forward_with_hidden_returns_the_same_logits(env: Any) -> None:  # noqa: ANN401 - conftest Env
    """Opt-in hidden states: bit-identical logits, and the hidden rows are the final norm's
    output (``lm_head`` of them is the logits)."""
    model = env.loaded.model
    plain, with_hidden = env.runner(kv_fill=float("nan")), env.runner(kv_fill=float("nan"))
    tokens = random_tokens(80, seed=3)
    sa, sb = plain.add(tokens), with_hidden.add(tokens)
    for n in (64, 10, 1, 1):
        want = plain.step([Work(sa, n)])[0]
        batch, _ = with_hidden.build([Work(sb, n)])
        logits, hidden = model.forward(batch, with_hidden.caches, return_hidden=True)
        sb.num_computed += n
        assert torch.equal(logits, want)
        assert hidden.shape == (n, model.config.hidden_size) and hidden.dtype == model.dtype
        assert torch.equal(model.lm_head(hidden).float(), logits)


def test_builtin_checkpoints_carry_an_mtp_head_beside_unchanged_weights(
    builtin_paths: dict[str, Path], envs: EnvFactory
) -> None:
    for name in ("tiny-qwen3.5", "tiny-qwen3-next"):
        folder = builtin_paths[name]
        assert json.loads((folder / "config.json").read_text())["mtp_num_hidden_layers"] == 1
        head = load_file(str(folder / MTP_WEIGHTS_FILE))
        assert set(head) == set(mtp_checkpoint_tensors(load(folder, envs, load_mtp=True).hf_config))
        assert not any(k.startswith("mtp.") for k in load_file(str(folder / "model.safetensors")))
        # Off by default: no head, no head tensors, caches exactly as before.
        default = load(folder, envs).model
        assert default.mtp is None and not any(k.startswith("mtp.") for k in default.state_dict())
        spec = default.cache_spec()
        assert spec.num_mtp_layers == 0 and spec.num_kv_layers == spec.num_attn_layers == 2
        loaded = load(folder, envs, load_mtp=True).model
        assert loaded.mtp is not None and loaded.mtp.num_layers == 1
        assert loaded.cache_spec() == spec
        with_mtp = loaded.cache_spec(with_mtp=True)
        assert with_mtp == dataclasses.replace(spec, num_mtp_layers=1)
        assert with_mtp.kv_block_bytes(16) * 2 == spec.kv_block_bytes(16) * 3
        assert torch.equal(loaded.mtp.fc.weight, head["mtp.fc.weight"])
        assert torch.equal(loaded.mtp.norm.weight, head["mtp.norm.weight"])
        # The head shares the target's embedding and head instead of holding copies.
        assert not [
            k for k in loaded.state_dict() if k.startswith("mtp.") and ("embed_tokens" in k or "lm_head" in k)
        ]
    moe = load_file(str(builtin_paths["tiny-qwen3-next"] / MTP_WEIGHTS_FILE))
    assert moe["mtp.layers.0.mlp.experts.3.gate_proj.weight"].shape == (256, 256)  # per expert, as published
    assert moe["mtp.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 256)
    assert not (builtin_paths["tiny-qwen3"] / MTP_WEIGHTS_FILE).exists()


def test_mtp_tensors_in_qwen35_08b_shapes() -> None:
    """The head ``tools/make_shaped_model.py`` writes for Qwen3.5-0.8B, in the published shapes."""
    import transformers

    shape = dict(SHAPES["qwen3.5-0.8b"])
    del shape["model_type"], shape["full_attention_interval"]
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 6
    config = transformers.Qwen3_5TextConfig(**shape, layer_types=layer_types)
    got = {k: tuple(v.shape) for k, v in mtp_checkpoint_tensors(config, dtype=torch.bfloat16).items()}
    p = "mtp.layers.0."
    assert got == {
        "mtp.fc.weight": (1024, 2048),
        "mtp.pre_fc_norm_embedding.weight": (1024,),
        "mtp.pre_fc_norm_hidden.weight": (1024,),
        "mtp.norm.weight": (1024,),
        p + "input_layernorm.weight": (1024,),
        p + "post_attention_layernorm.weight": (1024,),
        p + "self_attn.q_proj.weight": (4096, 1024),  # 8 heads x [q, gate] x 256
        p + "self_attn.k_proj.weight": (512, 1024),
        p + "self_attn.v_proj.weight": (512, 1024),
        p + "self_attn.o_proj.weight": (1024, 2048),
        p + "self_attn.q_norm.weight": (256,),
        p + "self_attn.k_norm.weight": (256,),
        p + "mlp.gate_proj.weight": (3584, 1024),
        p + "mlp.up_proj.weight": (3584, 1024),
        p + "mlp.down_proj.weight": (1024, 3584),
    }


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_and_misshaped_mtp_tensors(
    builtin_paths: dict[str, Path], tmp_path: Path, envs: EnvFactory
) -> None:
    path = _copy(builtin_paths["tiny-qwen3.5"], tmp_path / "m")
    head = load_file(str(path / MTP_WEIGHTS_FILE))
    del head["mtp.norm.weight"]
    head["mtp.fc.weight"] = torch.zeros(256, 256)
    save_file(head, str(path / MTP_WEIGHTS_FILE))
    with pytest.raises(WeightMismatchError) as exc:
        load(path, envs, load_mtp=True)
    assert str(exc.value) == (
        f"checkpoint in {path} does not match the model: 1 missing: mtp.norm.weight; "
        "1 mis-shaped: mtp.fc.weight: checkpoint (256, 256) vs model (256, 512)"
    )
    assert load(path, envs).model.mtp is None  # without load_mtp the head's tensors are not read
    (path / MTP_WEIGHTS_FILE).unlink()
    with pytest.raises(WeightMismatchError) as exc:
        load(path, envs, load_mtp=True)
    assert exc.value.missing == sorted(load_file(str(builtin_paths["tiny-qwen3.5"] / MTP_WEIGHTS_FILE)))
    assert str(exc.value).startswith(
        f"checkpoint in {path} does not match the model: 15 missing: mtp.fc.weight, mtp.layers.0."
    )
    assert str(exc.value).endswith(" (+7 more)")


def test_models_without_a_head_refuse_load_mtp(builtin_paths: dict[str, Path], envs: EnvFactory) -> None:
    dense = builtin_paths["tiny-qwen3"]
    with pytest.raises(UnsupportedModelError) as exc:
        load(dense, envs, load_mtp=True)
    assert str(exc.value) == f"{dense}: model_type 'qwen3' has no multi-token-prediction head"
    no_key = envs.write_checkpoint("qwen3_5-vl")  # ships a stray mtp.fc.weight, no mtp_num_hidden_layers
    with pytest.raises(UnsupportedModelError) as exc:
        load(no_key, envs, load_mtp=True)
    assert str(exc.value) == f"{no_key}: load_mtp needs config mtp_num_hidden_layers >= 1, found None"
    model = load(builtin_paths["tiny-qwen3.5"], envs).model
    with pytest.raises(ValueError, match=r"^this model has no MTP head \(load it with load_mtp=True\)$"):
        model.cache_spec(with_mtp=True)


def test_head_rejects_hidden_rows_not_aligned_with_the_batch(
    builtin_paths: dict[str, Path], envs: EnvFactory
) -> None:
    model = load(builtin_paths["tiny-qwen3.5"], envs, load_mtp=True).model
    runner = PagedRunner(model, ops=envs.ops, with_mtp=True)
    batch, _ = runner.build([Work(runner.add(random_tokens(8, seed=4)), 8)])
    assert model.mtp is not None
    with pytest.raises(ValueError, match=r"^hidden has 7 rows for a batch of 8 tokens$"):
        model.mtp(batch, torch.zeros(7, 256), runner.caches)


def test_arena_gives_the_head_its_kv_inside_each_block(
    builtin_paths: dict[str, Path], envs: EnvFactory
) -> None:
    """Shared mode: the head's K/V are the last layer of every block row, so a block's bytes (and
    every block move) carry them; state pages are unchanged."""
    model = load(builtin_paths["tiny-qwen3.5"], envs, load_mtp=True).model
    spec, base = model.cache_spec(with_mtp=True), model.cache_spec()
    lay, base_lay = spec.page_layout(16), base.page_layout(16)
    assert len(lay.k_offsets) == 3 and lay.k_offsets[:2] == base_lay.k_offsets
    assert lay.block_bytes == base_lay.block_bytes // 2 * 3 and lay.state_bytes == base_lay.state_bytes
    caches = spec.allocate_arena(2, 6, 16, "cpu")
    assert len(caches.k_cache) == len(caches.v_cache) == 3
    caches.v_cache[2][5].fill_(1.0)
    rows = caches.block_rows()
    assert rows[5].count_nonzero() > 0 and rows[4].count_nonzero() == 0 == rows[6].count_nonzero()


def test_vision_language_folder_loads_its_head(envs: EnvFactory, tmp_path: Path) -> None:
    """A ``qwen3_5`` folder keeps the head at the top level (``mtp.*``, not under
    ``model.language_model.``) and its layer count in ``text_config``."""
    path = _copy(envs.write_checkpoint("qwen3_5-vl"), tmp_path / "vl")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    text_config = load(path, envs).hf_config
    text_config.mtp_num_hidden_layers = 1
    head = mtp_checkpoint_tensors(text_config)
    save_file(head, str(path / "model-mtp.safetensors"))  # replaces the stray tensor the fixture ships
    model = load(path, envs, load_mtp=True).model
    assert model.mtp is not None and torch.equal(model.mtp.fc.weight, head["mtp.fc.weight"])
