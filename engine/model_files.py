"""What the engine reads from the model's folder before loading it: the path checked (one-line
``ConfigError``), ``model.max_model_len`` against the model's maximum, the model's sampling
defaults (``generation_config.json``) and a chat template file. Torch-free.

Contract:

* ``check_model(config)`` runs first in both placements (``EngineCore`` before it loads
  anything, ``ProcCoreClient.start`` before it spawns the core process). It raises
  ``ConfigError`` naming the key for: a ``model.path`` that is not a folder (a hub id such as
  ``Qwen/Qwen3.5-0.8B`` is fetched like vLLM does when ``huggingface_hub`` is installed, the
  hub is reachable and ``HF_HUB_OFFLINE`` is unset, or taken from the local hub cache; else the
  error says how to download it), a folder without ``config.json``, a ``model.max_model_len``
  above the model's ``max_position_embeddings``, a ``model.generation_config`` folder without
  ``generation_config.json`` or with invalid sampling values, an unreadable
  ``model.chat_template``. A hub id it downloaded replaces ``config.model.path`` (the snapshot's
  folder), so what is derived from the config afterwards names the local folder.
* ``sampling_defaults(model)`` -> ``(defaults, source)``: the ``SAMPLING_KEYS`` values that
  ``generation_config.json`` sets (``model.generation_config = "auto"``: the model folder's;
  a folder path: that folder's; ``"vllm"``: none, the built-in neutral defaults).
  ``InputProcessor`` applies them to the fields a request leaves unset.
* ``chat_template_text(model)``: the text of ``model.chat_template`` (None when unset);
  ``with_chat_template(tokenizer, model)``: a copy of the tokenizer with that template.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from deltaserve.engine.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from deltaserve.engine.config import EngineConfig, ModelConfig

BUILTIN_PREFIX = "builtin:"
#: generation_config.json keys that become request defaults (the SamplingParams fields vLLM's
#: ``--generation-config auto`` takes from the file)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
#: ``model.generation_config`` values that are not folders
GEN_AUTO, GEN_VLLM = "auto", "vllm"
#: how long the hub's reachability check may take before the error line is given instead
HUB_CONNECT_TIMEOUT_S = 3.0
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_TRUE = {"1", "true", "yes", "on"}


def check_model(config: EngineConfig) -> None:
    """The checks of the module docstring, in order; pins a downloaded hub id's folder."""
    model = config.model
    folder = model_folder(model.path, key="model.path")
    if folder is not None and not model.path.startswith(BUILTIN_PREFIX) and str(folder) != model.path:
        model.path = str(folder)  # a hub snapshot: the engine and the core process load this
    if model.max_model_len is not None:
        model_max = model_max_len(folder if folder is not None else _builtin_folder(model.path))
        if model_max is not None and model.max_model_len > model_max:
            raise ConfigError(
                f"model.max_model_len = {model.max_model_len}: above the model's maximum of {model_max} "
                f"tokens (max_position_embeddings in its config.json); use at most {model_max}"
            )
    sampling_defaults(model, folder)
    chat_template_text(model)


def model_folder(path: str, *, key: str) -> Path | None:
    """The local folder of ``path`` (None for ``builtin:<name>``, built on first load);
    ``ConfigError`` naming ``key`` for anything that is not a model folder."""
    if path.startswith(BUILTIN_PREFIX):
        return None
    folder = Path(path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"{key} = {path!r}: no config.json in this folder (a Hugging Face-format model folder "
                "has config.json, *.safetensors and the tokenizer files)"
            )
        return folder
    if folder.exists():
        raise ConfigError(f"{key} = {path!r}: not a folder (give the model's folder)")
    if _HUB_ID.fullmatch(path) and not path.startswith((".", "~")):
        return _from_hub(path, key)
    raise ConfigError(f"{key} = {path!r}: no such folder")


def _hub_offline(environ: Mapping[str, str]) -> bool:
    return environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _hub_reachable(environ: Mapping[str, str]) -> bool:
    """A TCP connection to the hub's endpoint opens within ``HUB_CONNECT_TIMEOUT_S``."""
    url = urlparse(environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=HUB_CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def _from_hub(repo_id: str, key: str) -> Path:
    """``repo_id``'s snapshot: from the local hub cache, else downloaded when the hub can be
    reached; ``ConfigError`` saying how to get the weights otherwise."""
    hint = (
        f"{key} = {repo_id!r}: no such folder; it looks like a Hugging Face hub id: download it with "
        f"`huggingface-cli download {repo_id} --local-dir DIR` and pass DIR"
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(hint + " (huggingface_hub is not installed here)") from None
    try:  # already in the hub cache: no network
        return _snapshot_folder(snapshot_download(repo_id, local_files_only=True), repo_id, key)
    except Exception:  # not cached (LocalEntryNotFoundError, ...): try the hub below
        pass
    if _hub_offline(os.environ):
        raise ConfigError(hint + " (HF_HUB_OFFLINE is set)")
    if not _hub_reachable(os.environ):
        raise ConfigError(hint + " (the hub cannot be reached from here)")
    from deltaserve.logs import get_logger

    get_logger("deltaserve.engine").info("engine.model_download", repo_id=repo_id)
    try:
        snapshot = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        )
    except Exception as e:  # huggingface_hub raises many types (not found, gated, network)
        raise ConfigError(f"{hint} (the download failed: {type(e).__name__}: {_first_line(e)})") from None
    return _snapshot_folder(snapshot, repo_id, key)


def _snapshot_folder(snapshot: str, repo_id: str, key: str) -> Path:
    folder = Path(snapshot)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key} = {repo_id!r}: the hub snapshot {folder} has no config.json")
    return folder


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _read_json(file: Path, key: str) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {file}: {_first_line(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {file} is not a JSON object")
    return data


def model_max_len(folder: Path) -> int | None:
    """``max_position_embeddings`` of ``folder``'s config.json (a vision-language folder's
    ``text_config``'s), or None when it does not say."""
    data = _read_json(folder / "config.json", "model.path")
    for section in (data, data.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _builtin_folder(path: str) -> Path:
    from deltaserve.models.builtin import ensure_builtin_model

    try:
        return ensure_builtin_model(path[len(BUILTIN_PREFIX) :])
    except ValueError as e:
        raise ConfigError(f"model.path = {path!r}: {e}") from None


def _generation_file(model: ModelConfig, folder: Path | None) -> Path | None:
    """The generation_config.json ``model.generation_config`` names (None: none is read)."""
    choice = model.generation_config
    if choice == GEN_VLLM:
        return None
    if choice == GEN_AUTO:
        if folder is None:
            folder = (
                _builtin_folder(model.path)
                if model.path.startswith(BUILTIN_PREFIX)
                else Path(model.path).expanduser()
            )
        file = folder / "generation_config.json"
        return file if file.is_file() else None
    file = Path(choice).expanduser() / "generation_config.json"
    if not file.is_file():
        raise ConfigError(
            f"model.generation_config = {choice!r}: no generation_config.json in that folder "
            f"(use auto, vllm or a folder holding one)"
        )
    return file


def sampling_defaults(model: ModelConfig, folder: Path | None = None) -> tuple[dict[str, Any], str]:
    """The model's request defaults and where they come from (module docstring); a value the
    sampler would refuse is a ``ConfigError`` naming the file and the key."""
    from deltaserve.engine.sampling_params import SamplingParams

    file = _generation_file(model, folder)
    if file is None:
        return {}, "vllm (built-in neutral defaults)" if model.generation_config == GEN_VLLM else "none"
    data = _read_json(file, "model.generation_config")
    defaults = {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}
    for name, value in defaults.items():
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as e:
            raise ConfigError(f"model.generation_config: {file}: {name} = {value!r}: {e}") from None
    return defaults, str(file)


def chat_template_text(model: ModelConfig) -> str | None:
    """The contents of ``model.chat_template`` (a Jinja file), or None when unset."""
    if model.chat_template is None:
        return None
    file = Path(model.chat_template).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"model.chat_template = {model.chat_template!r}: cannot read: {_first_line(e)}"
        ) from None
    if not text.strip():
        raise ConfigError(f"model.chat_template = {model.chat_template!r}: the file is empty")
    return text


def with_chat_template(tokenizer: Any, model: ModelConfig) -> Any:
    """``tokenizer``, or with ``model.chat_template`` set a copy of it whose template is that
    file's text: every reader of the template (rendering, the server's parser probes) then sees
    the same one, and a tokenizer shared with others (an engine built from a ``LoadedModel``
    passed in) keeps its own."""
    text = chat_template_text(model)
    if text is None:
        return tokenizer
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = text
    return tokenizer


def log_sampling_defaults(model: ModelConfig, defaults: dict[str, Any], source: str) -> None:
    """Log ``engine.sampling_defaults``: the request defaults in use (``sampling_defaults``'s
    answer) and their source, once, by the front end that applies them."""
    from deltaserve.logs import get_logger

    get_logger("deltaserve.engine").info(
        "engine.sampling_defaults", generation_config=model.generation_config, source=source, **defaults
    )
