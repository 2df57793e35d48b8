"""vLLM's and llama-server's flags on ``deltaserve serve`` (``server/cli_flags.py``): each shorthand
sets its config key, the Qwen3.5 model card's vLLM command line parses unchanged, refused flags
exit 2 with one line, ``--version``, the default host and its warning, TLS and ``--root-path`` on
a live server, a port in use found before the model loads, and the docs table and ``--help``
listing every flag of the table."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaserve.engine import EngineConfig
from deltaserve.engine.byte_size import bytes_arg
from deltaserve.engine.errors import ConfigError
from deltaserve.server.app import create_app
from deltaserve.server.cli import build_parser, engine_overrides, server_config_from_args
from deltaserve.server.cli_flags import (
    FLAGS,
    Arity,
    Kind,
    accepted_flags,
    docs_table,
    json_object,
    log_start,
    refusal,
    warn_open_host,
)
from deltaserve.server.config import ServerConfig
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.serving import BackgroundServer
from deltaserve.server.tool_parsers import ToolParserName
from tests.server.test_scripted_engine import ScriptedEngine

ROOT = Path(__file__).resolve().parents[2]
#: keys added by the model-defaults work (generation_config.json, a chat template file)
GENCFG_KEYS = {"model.generation_config", "model.chat_template"}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def sample(flag: Any) -> tuple[str, Any]:
    """A command-line value for ``flag`` and the value its key should get."""
    if flag.type is int:
        return "64", 64
    if flag.type is bytes_arg:
        return "4G", 4 << 30
    if flag.type is json_object:  # a whole section: its keys
        return '{"enable_kv_cache_events": true, "topic": "kv"}', {
            "enable_kv_cache_events": True,
            "topic": "kv",
        }
    enums = {"scheduler.policy": ("lpm", "lpm"), "model.ssm_state_dtype": ("bfloat16", "bfloat16")}
    return enums.get(flag.target, ("/tmp/x", "/tmp/x"))


#: one value per key (``--speculative-config``'s JSON object is a section: tested on its own)
SCALAR_KEY_FLAGS = [f for f in FLAGS if f.kind is Kind.KEY and f.target != "speculative"]
KEY_FLAGS = [(f, name) for f in SCALAR_KEY_FLAGS for name in f.names]


@pytest.mark.parametrize(("flag", "name"), KEY_FLAGS, ids=[n for _, n in KEY_FLAGS])
def test_each_shorthand_sets_its_key(flag: Any, name: str) -> None:
    if flag.arity is Arity.BOOL:
        assert engine_overrides(parse(name)) == {flag.target: True}
        assert engine_overrides(parse("--no-" + name[2:])) == {flag.target: False}
        return
    if flag.arity is Arity.NONE:
        assert engine_overrides(parse(name)) == {flag.target: flag.const}
        return
    text, value = sample(flag)
    if flag.type is json_object:
        assert engine_overrides(parse(name, text)) == {f"{flag.target}.{k}": v for k, v in value.items()}
        return
    assert engine_overrides(parse(name, text)) == {flag.target: value}


@pytest.mark.parametrize("flag", SCALAR_KEY_FLAGS, ids=lambda f: f.names[0])
def test_each_shorthand_key_is_an_engine_config_key(flag: Any, tmp_path: Path) -> None:
    if flag.target in GENCFG_KEYS and flag.target.split(".")[1] not in EngineConfig().model.__struct_fields__:
        pytest.skip(f"{flag.target} comes with the model-defaults work, not in this tree yet")
    value: Any = {Arity.BOOL: False, Arity.NONE: flag.const}.get(flag.arity, sample(flag)[1])
    if flag.target == "model.generation_config":
        value = "vllm"
    elif isinstance(value, str) and value.startswith("/tmp/"):
        value = str(tmp_path / "store")
        if flag.target == "model.chat_template":
            Path(value).write_text("{{ messages }}")
    if flag.type is json_object:
        config = EngineConfig.load(None, {f"{flag.target}.{k}": v for k, v in value.items()})
        assert all(getattr(getattr(config, flag.target), k) == v for k, v in value.items())
        return
    config = EngineConfig.load(None, {flag.target: value})
    section, key = flag.target.split(".")
    assert getattr(getattr(config, section), key) == value


def test_kv_events_config_is_vllms_json_and_its_keys_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from deltaserve.engine.cli import config_from_args

    text = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5600", "topic": "kv"}'
    config = config_from_args(
        parse("--kv-events-config", text), engine_overrides(parse("--kv-events-config", text))
    )
    assert (
        config.kv_events.active
        and config.kv_events.endpoint == "tcp://*:5600"
        and config.kv_events.topic == "kv"
    )
    with pytest.raises(ConfigError, match=r"^kv_events.endpoints: unknown key$"):
        args = parse("--kv-events-config", '{"endpoints": "tcp://*:1"}')
        config_from_args(args, engine_overrides(args))
    with pytest.raises(SystemExit) as e:
        parse("--kv-events-config", "[1]")
    assert (
        e.value.code == 2
        and "--kv-events-config: expected a JSON object, got '[1]'" in capsys.readouterr().err
    )


def test_the_shorthands_reach_the_engine_config() -> None:
    from deltaserve.engine.cli import config_from_args

    args = parse("--max-num-seqs", "8", "--max-num-batched-tokens", "4096", "--no-enable-prefix-caching",
                 "--block-size", "32", "--seed", "0", "-t", "1", "--disable-log-stats",
                 "--set", "model.seed=5")  # fmt: skip
    config = config_from_args(args, engine_overrides(args))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 4096)
    assert config.cache.enable_prefix_caching is False and config.cache.block_size == 32
    assert config.engine.cpu_threads == 1 and config.logging.stats_interval_s == 0.0
    assert config.model.seed == 5  # --set overrides the shorthand


def test_speculative_config_takes_vllms_json() -> None:
    from deltaserve.engine.cli import config_from_args

    args = parse(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6, "prompt_lookup_min": 3}',
        "--set",
        "speculative.prompt_lookup_min=2",
    )
    assert engine_overrides(args) == {
        "speculative.method": "ngram",
        "speculative.num_tokens": 5,
        "speculative.prompt_lookup_max": 6,
        "speculative.prompt_lookup_min": 3,
    }
    spec = config_from_args(args, engine_overrides(args)).speculative
    assert (spec.method.value, spec.num_tokens, spec.prompt_lookup_max) == ("ngram", 5, 6)
    assert spec.prompt_lookup_min == 2  # --set overrides the flag


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "ngram", "speculative_model": "x"}', "unknown key 'speculative_model' (known: method, "
         "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)"),
        ("[1]", "expected a JSON object, got '[1]'"),
        ("{method: ngram}", "not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ],
)  # fmt: skip
def test_speculative_config_refuses_what_it_cannot_read(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse("--speculative-config", text)
    assert e.value.code == 2
    assert f"argument --speculative-config: {message}" in capsys.readouterr().err


def test_speculative_config_values_are_checked_by_the_section() -> None:
    from deltaserve.engine.cli import config_from_args

    args = parse("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}')
    cfg = config_from_args(args, engine_overrides(args))
    assert (cfg.speculative.method.value, cfg.speculative.num_tokens) == ("mtp", 2)
    args = parse("--speculative-config", '{"num_speculative_tokens": 0}')
    with pytest.raises(ConfigError) as e:
        config_from_args(args, engine_overrides(args))
    assert str(e.value) == "speculative.num_tokens = 0: Expected `int` >= 1"


def test_two_flags_giving_one_key_different_values_are_an_error() -> None:
    with pytest.raises(ConfigError) as e:
        engine_overrides(parse("--max-model-len", "4096", "-c", "8192"))
    assert (
        str(e.value) == "--max-model-len 4096 and -c, --ctx-size 8192 both set model.max_model_len: give one"
    )
    assert engine_overrides(parse("--max-num-seqs", "8", "-np", "8")) == {"scheduler.max_num_seqs": 8}


def test_the_qwen3_5_model_card_command_line_parses_unchanged() -> None:
    args = parse("/models/Qwen3.5-0.8B", "--max-model-len", "262144", "--reasoning-parser", "qwen3",
                 "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--max-num-seqs", "8",
                 "--seed", "0", "--trust-remote-code", "--tensor-parallel-size", "1")  # fmt: skip
    assert engine_overrides(args) == {
        "model.path": "/models/Qwen3.5-0.8B",
        "model.max_model_len": 262144,
        "scheduler.max_num_seqs": 8,
        "model.seed": 0,
    }
    config = server_config_from_args(args, env={})
    assert config.tool_call_parser is ToolParserName.QWEN3_XML
    assert config.reasoning_parser is ReasoningParserName.QWEN3
    assert accepted_flags(args) == [
        "--enable-auto-tool-choice",
        "--trust-remote-code",
        "--tensor-parallel-size 1",
    ]


def test_llama_server_flags() -> None:
    args = parse("-m", "/models/q", "-c", "8192", "-np", "4", "-t", "2", "-a", "qwen", "--slot-save-path",
                 "/var/cache/ds", "-ngl", "99", "--jinja", "-fa")  # fmt: skip
    assert engine_overrides(args) == {
        "model.path": "/models/q",
        "model.max_model_len": 8192,
        "scheduler.max_num_seqs": 4,
        "engine.cpu_threads": 2,
        "cache.disk_path": "/var/cache/ds",
    }
    assert server_config_from_args(args, env={}).served_model_names == ["qwen"]
    assert accepted_flags(args) == ["-ngl 99", "--jinja", "-fa"]


REFUSED = [(f, name) for f in FLAGS if f.kind is Kind.REFUSED for name in f.names]


@pytest.mark.parametrize(("flag", "name"), REFUSED, ids=[n for _, n in REFUSED])
def test_refused_flags_exit_2_with_one_line(flag: Any, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [name] if flag.arity is Arity.NONE else [name, "2"]
    with pytest.raises(SystemExit) as e:
        parse(*argv, "--port", "0")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [refusal(flag, name, None if flag.arity is Arity.NONE else "2")]
    assert err.startswith(f"deltaserve serve: {' '.join(argv)} is not supported: ") and flag.note in err


def test_an_optional_value_never_swallows_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert accepted_flags(parse("/models/q", "-fa", "on", "--jinja")) == ["-fa on", "--jinja"]
    with pytest.raises(SystemExit) as e:
        parse("-fa", "/models/q")
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "deltaserve serve: -fa /models/q: expected on | off | auto (put MODEL first)"
    ]


def test_what_deltaserve_does_anyway_is_accepted() -> None:
    args = parse("-tp", "1", "--pipeline-parallel-size", "1", "--kv-cache-dtype", "auto")
    assert accepted_flags(args) == ["-tp 1", "--pipeline-parallel-size 1", "--kv-cache-dtype auto"]


def test_a_refused_flag_in_a_subprocess() -> None:
    cmd = [sys.executable, "-m", "deltaserve", "serve", "MODEL", "--tensor-parallel-size", "8", "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "deltaserve serve: --tensor-parallel-size 8 is not supported: one GPU per engine here; "
        "for data parallelism run --replicas N (docs/cluster.md)"
    ]


def test_version() -> None:
    done = subprocess.run([sys.executable, "-m", "deltaserve", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout == f"deltaserve {importlib.metadata.version('deltaserve')}\n"


# ---------------------------------------------------------------- the host
def test_the_default_host_is_every_interface() -> None:
    assert parse().host == "0.0.0.0"
    assert server_config_from_args(parse(), env={}).host == "0.0.0.0"
    assert ServerConfig().host == "127.0.0.1"  # code that builds a config binds loopback unless told


@pytest.mark.parametrize(
    ("host", "key", "warned"),
    [("0.0.0.0", None, True), ("::", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False),
     ("::1", None, False), ("localhost", None, False)],
)  # fmt: skip
def test_an_open_host_without_a_key_is_served_with_one_warning(
    host: str, key: str | None, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["--host", host, "--enable-auto-tool-choice"] + (["--api-key", key] if key else [])
    args = parse(*argv)
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        log_start(args)
        warn_open_host(server_config_from_args(args, env={}))
    events = [(r.levelname, r.event, r.fields) for r in caplog.records]  # type: ignore[attr-defined]
    assert events[0] == ("INFO", "serve.flags_accepted",
                         {"flags": ["--enable-auto-tool-choice"], "effect": "none (docs/server.md: From vLLM)"})  # fmt: skip
    assert [e[:2] for e in events[1:]] == ([("WARNING", "serve.no_api_key")] if warned else [])


# ---------------------------------------------------------------- server settings on a live server
def test_server_settings_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^server.ssl_certfile = '/nonexistent.pem': no such file"):
        server_config_from_args(parse("--ssl-certfile", "/nonexistent.pem"), env={})
    key = tmp_path / "key.pem"
    key.write_text("x")
    with pytest.raises(ConfigError, match=r"^server.ssl_keyfile without server.ssl_certfile"):
        server_config_from_args(parse("--ssl-keyfile", str(key)), env={})
    with pytest.raises(ConfigError, match=r"^server.root_path = 'api': '' or '/prefix'"):
        server_config_from_args(parse("--root-path", "api"), env={})
    with pytest.raises(ConfigError, match=r"^server.uvicorn_log_level = 'loud'"):
        server_config_from_args(parse("--uvicorn-log-level", "loud"), env={})


async def test_root_path_keeps_the_probes_open() -> None:
    config = server_config_from_args(parse("--root-path", "/api", "--api-key", "k"), env={})
    async with (
        BackgroundServer(create_app(ScriptedEngine(), config), config=config) as srv,
        httpx.AsyncClient(base_url=srv.url, timeout=10) as http,
    ):
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401
        r = await http.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["object"] == "list"


async def test_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)  # fmt: skip
    config = server_config_from_args(parse("--ssl-keyfile", str(key), "--ssl-certfile", str(cert)), env={})
    assert config.scheme == "https"
    async with BackgroundServer(create_app(ScriptedEngine(), config), config=config) as srv:
        async with httpx.AsyncClient(verify=False, timeout=10) as http:
            assert (await http.get(f"https://127.0.0.1:{srv.port}/health")).status_code == 200
        async with httpx.AsyncClient(timeout=10) as plain:
            with pytest.raises(httpx.HTTPError):  # no plain http on a TLS port
                await plain.get(f"http://127.0.0.1:{srv.port}/health")


# ---------------------------------------------------------------- a port in use
@pytest.mark.parametrize("placement", [["--in-process"], [], ["--api-server-count", "2"]])
def test_a_port_in_use_exits_2_before_the_model_loads(placement: list[str]) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        # --log-level info: loading would log engine.device first, so one line on stderr proves
        # that nothing was loaded
        cmd = [sys.executable, "-m", "deltaserve", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "info", *placement]  # fmt: skip
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        elapsed = time.monotonic() - t0
    finally:
        held.close()
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"deltaserve serve: 127.0.0.1:{port} is already in use; pass --port N (0: any free port)"
    ]
    assert elapsed < 30.0  # the interpreter's imports; a model load comes on top of them


def test_a_port_in_use_with_replicas_is_found_before_the_cluster_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import deltaserve.cluster.cli
    from deltaserve.__main__ import main as package_main

    started: list[int] = []
    monkeypatch.setattr(deltaserve.cluster.cli, "main_cluster", lambda *a: started.append(1) or 0)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["serve", "--replicas", "2", "--host", "127.0.0.1", "--port", str(port)]
        assert package_main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"deltaserve serve: 127.0.0.1:{port} is already in use; pass --port N (0: any free port)"
    ]
    assert started == []
    assert package_main(["serve", "--replicas", "2", "--host", "127.0.0.1", "--port", "0"]) == 0
    assert started == [1]  # a free port: the cluster gets it (closed again: the cluster binds it)


def test_an_address_not_on_this_machine_is_one_line() -> None:
    cmd = [sys.executable, "-m", "deltaserve", "serve", "--host", "192.0.2.1", "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "deltaserve serve: 192.0.2.1 is not an address of this machine; pass --host ADDRESS (0.0.0.0: all)"
    ]


# ---------------------------------------------------------------- one table: --help and the docs
def test_help_and_the_docs_list_every_flag_of_the_table() -> None:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    help_text = subparsers.choices["serve"].format_help()
    docs = (ROOT / "docs" / "server.md").read_text()
    section = re.search(r"<!-- flags table: begin -->\n(.*?)\n<!-- flags table: end -->", docs, re.S)
    assert section is not None and section.group(1) == docs_table(), (
        "docs/server.md's flags table is stale: paste server.cli_flags.docs_table()"
    )
    for flag in FLAGS:
        for name in flag.names:
            assert name in help_text, name
            assert f"`{flag.shown}`" in section.group(1), name


def test_the_model_card_recipe_serves() -> None:
    """The recipe's flags on a real ``serve`` (the tiny model; a length it can hold): it serves,
    logs the flags it accepts in one line, shows uvicorn's info lines, and exits 0 on SIGTERM."""
    import os
    import signal

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "deltaserve", "serve", "builtin:tiny-qwen3.5", "--max-model-len", "512",
           "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
           "--max-num-seqs", "8", "--seed", "0", "--host", "127.0.0.1", "--port", "0", "--in-process",
           "--set", "cache.memory_bytes=67108864", "--disable-log-stats", "--uvicorn-log-level", "info"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        assert first.startswith("deltaserve: serving builtin:tiny-qwen3.5 at http://127.0.0.1:"), first + (
            proc.stderr.read() if proc.poll() is not None else ""
        )
        url = first.split(" at ")[1].split()[0]
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/models").json()["data"][0]["id"] == "builtin:tiny-qwen3.5"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read().splitlines()
        accepted = [line for line in err if "serve.flags_accepted" in line]
        assert len(accepted) == 1 and "--enable-auto-tool-choice" in accepted[0]
        assert any(" uvicorn.error: " in line for line in err), err  # --uvicorn-log-level info
        assert not any("engine.stats" in line for line in err)  # --disable-log-stats
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_max_body_bytes_takes_units() -> None:
    """The one size the command line takes directly reads units as the config does."""
    args = build_parser().parse_args(["serve", "--max-body-bytes", "4MiB"])
    assert server_config_from_args(args).max_body_bytes == 4 * 1024 * 1024
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-body-bytes", "4XB"])
