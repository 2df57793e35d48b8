"""``deltaserve serve MODEL`` as a user runs it: the positional model, shorthands, several served
names and the API key from the environment, checked with the official client and httpx."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

KEY = "sk-env-key"


def test_positional_model_names_and_key_from_the_environment() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DELTASERVE_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "deltaserve", "serve", "builtin:tiny-qwen3.5", "--host", "127.0.0.1", "--port", "0",
           "--max-model-len", "320", "--log-level", "warning", "--set", "cache.memory_bytes=67108864",
           "--set", "logging.stats_interval_s=60", "--served-model-name", "tiny", "Qwen/tiny"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("deltaserve: serving tiny at http://127.0.0.1:"), first + (
            proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
        )
        url = first.split(" at ")[1].split()[0]  # .../v1
        with httpx.Client(timeout=60) as http:
            assert http.get(url + "/models").status_code == 401
            assert http.get(url.removesuffix("/v1") + "/health").status_code == 200
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "Qwen/tiny"]
        card = client.models.retrieve("Qwen/tiny")
        assert card.id == "Qwen/tiny" and card.model_extra is not None
        assert card.model_extra["max_model_len"] == 320  # --max-model-len reached the engine
        assert card.model_extra["root"] == "builtin:tiny-qwen3.5"  # the positional MODEL
        done = client.completions.create(model="Qwen/tiny", prompt="Hello", max_tokens=3)
        assert done.model == "Qwen/tiny" and done.usage is not None and done.usage.completion_tokens <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
