"""Units of the HTTP surface that need no server: the bearer key check, the config's repr, the
command line's shorthands and positional model."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deltaserve.engine.cli import config_from_args
from deltaserve.engine.config import CoreProcess, DType, EngineConfig
from deltaserve.engine.errors import ConfigError
from deltaserve.models import ensure_builtin_model
from deltaserve.server import auth
from deltaserve.server.cli import API_KEY_ENV, build_parser, engine_overrides, server_config_from_args
from deltaserve.server.cli import main as cli_main
from deltaserve.server.config import ServerConfig

KEY = "sk-test-0123456789"


def test_key_matches() -> None:
    key = b"k1"
    assert auth.key_matches(b"Bearer k1", key) and auth.key_matches(b"BEARER k1", key)
    assert auth.key_matches(b"Bearer  k1 ", key)  # stray spaces around the token
    for header in (b"", b"Bearer", b"Bearer k", b"Bearer k12", b"Token k1", b"k1", b"Bearer K1"):
        assert not auth.key_matches(header, key), header


def test_the_key_stays_out_of_the_config_repr() -> None:
    text = repr(ServerConfig(api_key=KEY, port=9))
    assert KEY not in text and "api_key='***'" in text and "port=9" in text
    assert "api_key=None" in repr(ServerConfig())


# ---------------------------------------------------------------------------- command line
def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(args, engine_overrides(args))


def test_positional_model_and_shorthands_set_config_keys() -> None:
    args = parse(
        "builtin:tiny-qwen3", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
        "--tokenizer", "builtin:tiny-qwen3.5", "--dtype", "bfloat16", "--served-model-name", "a", "b",
        "--device", "cuda:1",
    )  # fmt: skip
    config = engine_config(args)
    assert config.model.path == "builtin:tiny-qwen3"
    assert config.model.max_model_len == 512
    assert config.cache.gpu_memory_utilization == 0.5
    assert config.model.tokenizer == "builtin:tiny-qwen3.5"
    assert config.model.dtype is DType.BFLOAT16
    assert config.model.device == "cuda:1"
    assert server_config_from_args(args, env={}).served_model_names == ["a", "b"]
    # nothing given: the config's defaults, untouched
    default = engine_config(parse())
    assert default == EngineConfig() and engine_overrides(parse()) == {}


def test_model_option_and_precedence(tmp_path: Path) -> None:
    assert engine_config(parse("--model", "builtin:tiny-qwen3")).model.path == "builtin:tiny-qwen3"
    assert engine_config(parse("builtin:tiny-qwen3", "--model", "builtin:tiny-qwen3")).model.path == (
        "builtin:tiny-qwen3"
    )
    with pytest.raises(ConfigError, match="MODEL 'builtin:a' and --model 'builtin:b' differ"):
        engine_overrides(parse("builtin:a", "--model", "builtin:b"))
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nmax_model_len = 100\n[cache]\ngpu_memory_utilization = 0.3\n")
    # a shorthand overrides the config file; --set overrides the shorthand
    config = engine_config(
        parse("--config", str(toml), "--max-model-len", "200", "--set", "cache.gpu_memory_utilization=0.7",
              "--gpu-memory-utilization", "0.6")
    )  # fmt: skip
    assert config.model.max_model_len == 200 and config.cache.gpu_memory_utilization == 0.7
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        engine_config(parse("--gpu-memory-utilization", "1.5"))
    with pytest.raises(SystemExit):  # argparse: not a number
        parse("--max-model-len", "many")


def test_api_key_from_the_option_or_the_environment() -> None:
    assert server_config_from_args(parse(), env={}).api_key is None
    assert server_config_from_args(parse(), env={API_KEY_ENV: "from-env"}).api_key == "from-env"
    assert server_config_from_args(parse("--api-key", "opt"), env={API_KEY_ENV: "opt"}).api_key == "opt"
    with pytest.raises(ConfigError, match="both set, to different keys"):  # which one guards: a guess
        server_config_from_args(parse("--api-key", "opt"), env={API_KEY_ENV: "env"})
    assert server_config_from_args(parse(), env={"VLLM_API_KEY": "v"}).api_key is None  # not ours
    with pytest.raises(ConfigError, match="api_key"):
        ServerConfig(api_key=" ")


def test_cors_options() -> None:
    config = server_config_from_args(parse(), env={})
    assert config.allowed_origins == [] and config.allowed_methods == ["*"] and not config.allow_credentials
    config = server_config_from_args(
        parse("--allowed-origins", '["http://a.example", "http://b.example"]', "--allowed-origins",
              "http://c.example", "--allowed-methods", "GET,POST", "--allowed-headers", "authorization",
              "--allow-credentials"),
        env={},
    )  # fmt: skip
    assert config.allowed_origins == ["http://a.example", "http://b.example", "http://c.example"]
    assert config.allowed_methods == ["GET", "POST"] and config.allowed_headers == ["authorization"]
    assert config.allow_credentials
    with pytest.raises(ConfigError, match=r"--allowed-origins '\[1\]': must be a list of strings"):
        server_config_from_args(parse("--allowed-origins", "[1]"), env={})
    with pytest.raises(ConfigError, match="not a JSON list"):
        server_config_from_args(parse("--allowed-origins", "[oops"), env={})


def test_export_tokenizer_writes_a_loadable_copy(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "tok"
    assert cli_main(["export-tokenizer", str(out)]) == 0
    exported = AutoTokenizer.from_pretrained(out)
    original = AutoTokenizer.from_pretrained(ensure_builtin_model("tiny-qwen3.5"))
    text = "Hello! The quick brown fox, 42 times."
    assert exported.encode(text) == original.encode(text) and len(exported) == len(original)
    messages = [{"role": "user", "content": "hi"}]
    assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert cli_main(["export-tokenizer", str(tmp_path / "x"), "--model", str(tmp_path / "missing")]) == 2


def test_model_tokenizer_key_loads_that_tokenizer(tmp_path: Path) -> None:
    import torch

    from deltaserve.kernels import get_ops
    from deltaserve.models import load_model
    from deltaserve.models.loader import TokenizerLoadError

    out = tmp_path / "tok"
    assert cli_main(["export-tokenizer", str(out)]) == 0
    template = "{%- for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{%- endfor %}"
    (out / "chat_template.jinja").write_text(template)
    ops = get_ops("reference")
    loaded = load_model(
        "builtin:tiny-qwen3.5", dtype=torch.float32, device="cpu", ops=ops, tokenizer=str(out)
    )
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "[user] hi"
    with pytest.raises(TokenizerLoadError, match="tokenizer folder not found"):
        load_model(
            "builtin:tiny-qwen3.5", dtype=torch.float32, device="cpu", ops=ops, tokenizer=str(tmp_path / "no")
        )


def test_a_key_with_replicas_is_refused_not_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    from deltaserve.__main__ import main as package_main

    assert package_main(["serve", "--replicas", "2", "--api-key", "k"]) == 2
    assert "--api-key and the CORS options are not applied with --replicas" in capsys.readouterr().err
    assert package_main(["serve", "--replicas", "2", "--allowed-origins", "*"]) == 2


def test_the_engine_core_runs_in_its_own_process_unless_asked_otherwise() -> None:
    assert EngineConfig().engine.core_process is CoreProcess.AUTO
    assert "engine.core_process" not in engine_overrides(parse())
    assert engine_overrides(parse("--in-process"))["engine.core_process"] == "in_process"
    assert engine_overrides(parse("--engine-process"))["engine.core_process"] == "separate"
    with pytest.raises(ConfigError, match=r"--api-server-count > 1 shares one engine core process"):
        engine_overrides(parse("--in-process", "--api-server-count", "2"))
    with pytest.raises(SystemExit):
        parse("--in-process", "--engine-process")
