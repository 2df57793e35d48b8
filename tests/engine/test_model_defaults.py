"""The model's sampling defaults (generation_config.json, ``model.generation_config``) and the
model-folder checks that run before anything loads (``engine/model_files.py``).

A copy of the built-in tiny model whose generation_config.json recommends temperature 0.6,
top_p 0.95 and top_k 20: a request that leaves those fields unset samples exactly as one that
sets them to those values; a field the request sets (temperature=0 and 1.0 included) wins;
``vllm`` ignores the file; a folder path is read instead of the model's. Both placements
(``AsyncEngine`` and ``AsyncEngine`` over ``ProcCoreClient``) and the HTTP server behave the same, because the
defaults are applied by the ``InputProcessor`` (the front door of each).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams
from deltaserve.engine.errors import ConfigError, PromptTooLongError
from deltaserve.engine.front.client import RequestInput
from deltaserve.engine.model_files import check_model, sampling_defaults
from deltaserve.models import LoadedModel, ensure_builtin_model
from tests.engine.conftest import make_config, separate

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
PROMPT = "Hello there"


def _model_copy(folder: Path, generation: dict[str, Any] | None) -> Path:
    """The tiny model's files linked into ``folder``, with ``generation`` as generation_config.json."""
    src = ensure_builtin_model("tiny-qwen3.5")
    folder.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], **generation}))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_copy(tmp_path_factory.mktemp("gen") / "model", RECOMMENDED)


def _processed(engine: Any, params: SamplingParams | None) -> SamplingParams:
    return engine.input_processor.process(RequestInput(prompt=PROMPT, sampling_params=params)).sampling_params


# ---------------------------------------------------------------------------- SamplingParams
def test_unset_fields_are_told_apart_from_explicit_neutral_values() -> None:
    unset, explicit = SamplingParams(), SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    assert unset == explicit  # the same values
    assert unset.is_unset("temperature") and not explicit.is_unset("temperature")
    filled = unset.with_defaults(RECOMMENDED)
    assert (filled.temperature, filled.top_p, filled.top_k) == (0.6, 0.95, 20)
    assert explicit.with_defaults(RECOMMENDED) is explicit
    greedy = SamplingParams(temperature=0).with_defaults(RECOMMENDED)
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0, 0.95, 20)
    # across the core-process wire (msgpack, markers never encoded) and pickle (Ray): kept apart
    for codec in (
        lambda p: msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams),
        lambda p: pickle.loads(pickle.dumps(p)),
    ):
        assert codec(unset).is_unset("top_k") and not codec(explicit).is_unset("top_k")
        assert codec(explicit).with_defaults(RECOMMENDED).temperature == 1.0


# ---------------------------------------------------------------------------- config
def test_sampling_defaults_by_mode(model_dir: Path, tmp_path: Path) -> None:
    cfg = EngineConfig.load(None, {"model.path": str(model_dir)})
    assert sampling_defaults(cfg.model) == (RECOMMENDED, str(model_dir / "generation_config.json"))
    vllm = cfg.replace(**{"model.generation_config": "vllm"})
    assert sampling_defaults(vllm.model)[0] == {}
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(
        json.dumps({"temperature": 0.2, "min_p": 0.1, "do_sample": True})
    )
    folder = cfg.replace(**{"model.generation_config": str(other)})
    assert sampling_defaults(folder.model)[0] == {"temperature": 0.2, "min_p": 0.1}
    # the built-in models carry no sampling values: their tests' outputs are unchanged
    assert sampling_defaults(EngineConfig().model)[0] == {}


def test_bad_generation_config_is_one_config_error(model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "none"
    empty.mkdir()
    cfg = EngineConfig.load(None, {"model.path": str(model_dir), "model.generation_config": str(empty)})
    with pytest.raises(ConfigError, match=r"^model.generation_config = '.*none': no generation_config.json"):
        check_model(cfg)
    (empty / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ConfigError, match=r"model.generation_config: .*temperature = -1: "):
        check_model(cfg)


# ---------------------------------------------------------------------------- engine
async def _tokens(engine: Any, params: SamplingParams | None) -> list[int]:
    out: list[int] = []
    async for o in engine.generate(PROMPT, params):
        out += o.token_ids
    return out


async def _check_engine(engine: Any) -> None:
    """Unset fields take the model's values, set ones win, in what is processed and sampled."""
    p = _processed(engine, SamplingParams(seed=3, temperature=0))
    assert (p.temperature, p.top_p, p.top_k) == (0, 0.95, 20)
    p = _processed(engine, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.95, 20, 0.0)
    unset = await _tokens(engine, SamplingParams(seed=7, max_tokens=12))
    same = await _tokens(engine, SamplingParams(seed=7, max_tokens=12, **RECOMMENDED))
    neutral = await _tokens(
        engine, SamplingParams(seed=7, max_tokens=12, temperature=1.0, top_p=1.0, top_k=0)
    )
    assert unset == same
    assert unset != neutral  # the explicit neutral values were not replaced by the model's


async def test_async_engine_applies_the_model_defaults(
    model_dir: Path, tiny_loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    from deltaserve.engine import EngineCore

    caplog.set_level(logging.INFO, logger="deltaserve")
    core = EngineCore(make_config(**{"model.path": str(model_dir)}), loaded=tiny_loaded)
    async with AsyncEngine(core=core) as engine:
        await _check_engine(engine)
    logged = [r.getMessage() for r in caplog.records if "engine.sampling_defaults" in r.getMessage()]
    assert len(logged) == 1 and "temperature=0.6" in logged[0] and "top_k=20" in logged[0], logged


async def test_vllm_mode_ignores_the_file(model_dir: Path, tiny_loaded: LoadedModel) -> None:
    from deltaserve.engine import EngineCore

    cfg = make_config(**{"model.path": str(model_dir), "model.generation_config": "vllm"})
    async with AsyncEngine(core=EngineCore(cfg, loaded=tiny_loaded)) as engine:
        p = _processed(engine, SamplingParams())
        assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)
        unset = await _tokens(engine, SamplingParams(seed=7, max_tokens=12))
        neutral = await _tokens(
            engine, SamplingParams(seed=7, max_tokens=12, temperature=1.0, top_p=1.0, top_k=0)
        )
        assert unset == neutral


async def test_a_generation_config_folder(tmp_path: Path, tiny_loaded: LoadedModel) -> None:
    from deltaserve.engine import EngineCore

    plain = _model_copy(tmp_path / "plain", None)  # no generation_config.json of its own
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    for mode, want in (("auto", (1.0, 1.0, 0)), (str(gen), (0.6, 0.95, 20))):
        cfg = make_config(**{"model.path": str(plain), "model.generation_config": mode})
        async with AsyncEngine(core=EngineCore(cfg, loaded=tiny_loaded)) as engine:
            p = _processed(engine, SamplingParams(top_k=5))
            assert (p.temperature, p.top_p, p.top_k) == (*want[:2], 5), mode


async def test_separate_core_process_applies_the_same_defaults(model_dir: Path) -> None:

    cfg = make_config(**{"model.path": str(model_dir), "engine.core_process": "separate"})
    async with AsyncEngine(separate(cfg)) as engine:
        await _check_engine(engine)


async def test_http_requests_take_the_model_defaults(model_dir: Path, tiny_loaded: LoadedModel) -> None:
    from deltaserve.engine import EngineCore
    from deltaserve.server.app import create_app
    from deltaserve.server.config import ServerConfig
    from deltaserve.server.serving import BackgroundServer

    core = EngineCore(make_config(**{"model.path": str(model_dir)}), loaded=tiny_loaded)
    async with AsyncEngine(core=core) as engine:
        app = create_app(engine, ServerConfig(served_model_names=["m"]))
        async with BackgroundServer(app) as srv, httpx.AsyncClient(base_url=srv.url, timeout=60) as client:

            async def ids(**fields: Any) -> list[int]:
                body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "seed": 7, "return_token_ids": True}
                r = await client.post("/v1/completions", json={**body, **fields})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]

            unset = await ids()
            assert unset == await ids(**RECOMMENDED)
            assert unset != await ids(temperature=1.0, top_p=1.0, top_k=0)
            greedy = await ids(temperature=0)
            assert greedy == await _tokens(engine, SamplingParams(max_tokens=12, temperature=0, top_k=0))


# ---------------------------------------------------------------------------- model checks
def test_max_model_len_above_the_model_maximum_is_refused(model_dir: Path) -> None:
    cfg = EngineConfig.load(None, {"model.path": str(model_dir), "model.max_model_len": 100000})
    with pytest.raises(ConfigError) as e:
        check_model(cfg)
    assert str(e.value) == (
        "model.max_model_len = 100000: above the model's maximum of 8192 tokens "
        "(max_position_embeddings in its config.json); use at most 8192"
    )
    check_model(cfg.replace(**{"model.max_model_len": 8192}))  # the maximum itself is fine
    with pytest.raises(ConfigError, match="above the model's maximum of 8192"):
        check_model(EngineConfig.load(None, {"model.max_model_len": 8193}))  # a built-in model


def test_model_path_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # (the hub cache location is read when huggingface_hub is imported: an id no cache holds)

    def error(path: str) -> str:
        with pytest.raises(ConfigError) as e:
            check_model(EngineConfig.load(None, {"model.path": path}))
        return str(e.value)

    assert error(str(tmp_path / "nope")) == f"model.path = '{tmp_path / 'nope'}': no such folder"
    assert error(str(tmp_path)).startswith(f"model.path = '{tmp_path}': no config.json in this folder")
    hub = error("Org/No-Such-Model-5e1f")
    assert hub.startswith(
        "model.path = 'Org/No-Such-Model-5e1f': no such folder; it looks like a Hugging Face hub id"
    )
    assert "huggingface-cli download Org/No-Such-Model-5e1f --local-dir DIR" in hub
    assert hub.endswith("(HF_HUB_OFFLINE is set)") and "\n" not in hub


def test_a_chat_template_file_that_cannot_be_read(tmp_path: Path) -> None:
    cfg = EngineConfig.load(None, {"model.chat_template": str(tmp_path / "t.jinja")})
    with pytest.raises(ConfigError, match=r"^model.chat_template = '.*t.jinja': cannot read: "):
        check_model(cfg)


def test_a_long_prompt_logs_no_transformers_length_warning(
    tiny_loaded: LoadedModel, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import copy

    from deltaserve.engine.front.input_processor import InputProcessor

    tokenizer = copy.deepcopy(tiny_loaded.tokenizer)
    tokenizer.deprecation_warnings.clear()  # as loaded: it has warned of nothing yet
    tokenizer.model_max_length = 32  # below the prompt: transformers would warn
    processor = InputProcessor(tokenizer, max_model_len=64, vocab_size=1024, salt_parts=())
    caplog.set_level(logging.WARNING)
    long_prompt = " ".join(["x"] * 100)  # 199 tokens in 199 characters: tokenized, then refused
    with pytest.raises(PromptTooLongError, match=r"^prompt has 199 tokens; max_model_len is 64"):
        processor.process(RequestInput(prompt=long_prompt))
    err = capfd.readouterr().err
    assert "indexing errors" not in err and not any(
        "indexing errors" in r.getMessage() for r in caplog.records
    )
    # only that warning is marked as given: model_max_length and the other warnings are untouched
    assert tokenizer.model_max_length == 32
    assert list(tokenizer.deprecation_warnings) == ["sequence-length-is-longer-than-the-specified-maximum"]


def _serve(args: list[str], hub_cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "deltaserve", "serve", *args, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_a_hub_id_in_the_local_hub_cache_is_served_from_there(tmp_path: Path) -> None:
    """Offline, a hub id found in the hub cache resolves to its snapshot folder (shown here by
    the max_model_len check, which reads the snapshot's config.json before anything loads)."""
    repo = tmp_path / "hub" / "models--Org--Tiny"
    _model_copy(repo / "snapshots" / "0123abcd", RECOMMENDED)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    proc = _serve(["Org/Tiny", "--max-model-len", "9000", "--in-process"], tmp_path / "hub")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "deltaserve: error: model.max_model_len = 9000: above the model's maximum of 8192 tokens "
        "(max_position_embeddings in its config.json); use at most 8192"
    )


@pytest.mark.parametrize("placement", [[], ["--in-process"]], ids=["separate", "in_process"])
@pytest.mark.parametrize("model", ["/no/such/dir", "Qwen/Qwen3.5-0.8B"])
def test_serve_prints_one_line_for_a_bad_model(model: str, placement: list[str], tmp_path: Path) -> None:
    """``deltaserve serve`` exits 2 with one line on stderr, before loading anything, in both
    placements (no traceback: the check raises a ConfigError before the core starts)."""
    proc = _serve([model, *placement], tmp_path / "hub")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"deltaserve: error: model.path = '{model}': no such folder")
    if "/no/" not in model:
        assert f"huggingface-cli download {model} --local-dir DIR" in lines[0]
