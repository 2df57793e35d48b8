"""Load a model + tokenizer from a local Hugging Face-format folder (or ``builtin:<name>``).

Contract:

* ``load_model(path, *, dtype, device, ops, load_mtp=False) -> LoadedModel``. ``path`` is a folder with
  ``config.json``, ``*.safetensors`` (one file or shards, with or without an index) and a
  tokenizer loadable by ``AutoTokenizer``; or ``"builtin:<name>"`` (built on first use by
  ``models.builtin.ensure_builtin_model``). ``tokenizer=`` (a folder, or ``builtin:<name>``)
  loads the tokenizer from there instead.
* The model class is chosen by ``config.json``'s ``model_type`` (``SUPPORTED_MODEL_TYPES``).
  ``qwen3_5`` (vision-language) folders load only the text model: tensors under
  ``model.language_model.`` become ``model.``; ``model.visual.*`` is skipped.
* ``mtp.*`` (the multi-token-prediction head) is skipped unless ``load_mtp``: then the model
  is built with ``config``'s ``mtp_num_hidden_layers`` head layers (``model.mtp``,
  ``models/mtp.py``) and every ``mtp.*`` tensor must match it like any other tensor
  (``WeightMismatchError``); a model type without a head, or a config without
  ``mtp_num_hidden_layers`` >= 1, is an ``UnsupportedModelError``.
* Every floating tensor is converted to ``dtype`` on ``device``; the module is built on the
  meta device first, so weights are materialised once.
* Errors are ``ModelLoadError`` subclasses: ``ModelNotFoundError`` (no folder / no
  config.json / no weights), ``UnsupportedModelError`` (unknown ``model_type`` or an
  unsupported config feature), ``WeightMismatchError`` (missing, unexpected or mis-shaped
  tensors, listed), ``TokenizerLoadError``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from deltaserve.models.decoder import CausalLM
from deltaserve.models.fusion import fuse_model
from deltaserve.models.norms import use_norm_kernel
from deltaserve.models.qwen3 import Qwen3CausalLM
from deltaserve.models.qwen3_5 import Qwen35CausalLM
from deltaserve.models.qwen3_next import Qwen3NextCausalLM

if TYPE_CHECKING:
    from deltaserve.kernels import Ops

BUILTIN_PREFIX = "builtin:"
_MAX_LISTED = 8


class ModelLoadError(Exception):
    """Base of every error raised while loading a model folder."""


class ModelNotFoundError(ModelLoadError):
    pass


class UnsupportedModelError(ModelLoadError):
    pass


class WeightMismatchError(ModelLoadError):
    def __init__(self, message: str, missing: list[str], unexpected: list[str], mismatched: list[str]):
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched


class TokenizerLoadError(ModelLoadError):
    pass


@dataclass(frozen=True)
class ModelEntry:
    """How to build one ``model_type`` and map its checkpoint names onto our module tree."""

    model_cls: type[CausalLM]
    # Checkpoint name prefix that holds the text model's ``model.*`` tensors.
    text_prefix: str = "model."
    # Checkpoint name prefixes that are not part of the text model.
    skip_prefixes: tuple[str, ...] = ("mtp.",)
    # The class builds an MTP head (``mtp_layers=``) from the ``mtp.*`` tensors.
    has_mtp: bool = True


SUPPORTED_MODEL_TYPES: Mapping[str, ModelEntry] = MappingProxyType(
    {
        "qwen3_5_text": ModelEntry(Qwen35CausalLM),
        "qwen3_5": ModelEntry(
            Qwen35CausalLM, text_prefix="model.language_model.", skip_prefixes=("mtp.", "model.visual.")
        ),
        "qwen3_next": ModelEntry(Qwen3NextCausalLM),
        "qwen3": ModelEntry(Qwen3CausalLM, has_mtp=False),
    }
)


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Any
    hf_config: Any  # the transformers *text* config the model was built from
    model_type: str  # config.json's model_type (e.g. "qwen3_5" for a VL folder)
    eos_token_ids: list[int]
    max_position_embeddings: int
    path: Path


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: Ops,
    tokenizer: str | Path | None = None,
    load_mtp: bool = False,
) -> LoadedModel:
    """The model in ``path``; its tokenizer from ``tokenizer`` (a folder or ``builtin:<name>``)
    when given, else from ``path``; with its MTP head (``model.mtp``) when ``load_mtp``."""
    folder = _resolve_folder(path)
    model_type = _read_model_type(folder)
    entry = SUPPORTED_MODEL_TYPES[model_type]

    from transformers import AutoConfig

    top_config = AutoConfig.from_pretrained(folder)
    text_config = top_config.get_text_config()
    # A VL folder's top-level flag is the one transformers honours for the text head.
    tie = bool(getattr(top_config, "tie_word_embeddings", False))
    extra = {"mtp_layers": _mtp_layers(folder, model_type, entry, text_config)} if load_mtp else {}
    try:
        with torch.device("meta"):
            model = entry.model_cls(text_config, ops=ops, tie_word_embeddings=tie, **extra)
    except (ValueError, NotImplementedError) as exc:
        raise UnsupportedModelError(f"{folder}: {exc}") from exc

    if load_mtp:  # the head's tensors are part of the model now: checked like every other
        entry = replace(entry, skip_prefixes=tuple(p for p in entry.skip_prefixes if p != "mtp."))
    state = {}
    for name, tensor in _read_checkpoint(folder, entry, device):
        state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    state = model.convert_checkpoint(state)
    _check_weights(folder, model, state)
    model.load_state_dict(state, strict=False, assign=True)
    state.clear()  # the model holds the tensors now: fusion below frees each original it replaces
    model.tie_weights()
    fuse_model(model)  # one matmul per group of projections sharing an input
    use_norm_kernel(model, ops.rms_norm)  # one launch per norm where the backend fuses it
    model.to(device)  # non-checkpoint buffers (rope frequencies) follow the weights
    model.eval().requires_grad_(False)

    tokenizer = _load_tokenizer(_tokenizer_folder(tokenizer) if tokenizer is not None else folder)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=text_config,
        model_type=model_type,
        eos_token_ids=_eos_token_ids(folder, top_config, text_config, tokenizer),
        max_position_embeddings=int(text_config.max_position_embeddings),
        path=folder,
    )


def _mtp_layers(folder: Path, model_type: str, entry: ModelEntry, text_config: Any) -> int:
    """How many MTP head layers ``load_mtp`` builds (config ``mtp_num_hidden_layers``)."""
    if not entry.has_mtp:
        raise UnsupportedModelError(f"{folder}: model_type {model_type!r} has no multi-token-prediction head")
    layers = getattr(text_config, "mtp_num_hidden_layers", None)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise UnsupportedModelError(
            f"{folder}: load_mtp needs config mtp_num_hidden_layers >= 1, found {layers!r}"
        )
    return layers


def _resolve_folder(path: str | Path) -> Path:
    if isinstance(path, str) and path.startswith(BUILTIN_PREFIX):
        from deltaserve.models.builtin import ensure_builtin_model

        name = path[len(BUILTIN_PREFIX) :]
        try:
            return ensure_builtin_model(name)
        except ValueError as exc:
            raise ModelNotFoundError(str(exc)) from exc
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder not found: {folder}")
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"no config.json in model folder {folder}")
    return folder


def _read_model_type(folder: Path) -> str:
    # Read the raw JSON first: AutoConfig would fail on an unknown type with a less useful message.
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} in {folder / 'config.json'} (supported: {supported})"
        )
    return model_type


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def _read_checkpoint(
    folder: Path, entry: ModelEntry, device: torch.device | str
) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    files = _weight_files(folder)
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in model folder {folder}")
    rename = _renamer(entry)
    for file in files:
        if not file.is_file():
            raise ModelNotFoundError(f"weight file listed in the index is missing: {file}")
        # CPU: each tensor is read (pread) into memory of its own, so the weights are resident
        # once (a memory map stays mapped, and resident, beside the fused copies of its tensors)
        backend = "pread" if torch.device(device).type == "cpu" else "mmap"
        with safe_open(str(file), framework="pt", device=str(torch.device(device)), backend=backend) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                name = rename(key)
                if name is not None:
                    yield name, f.get_tensor(key)


def _renamer(entry: ModelEntry) -> Callable[[str], str | None]:
    def rename(key: str) -> str | None:
        if key.startswith(entry.skip_prefixes) or key.endswith("rotary_emb.inv_freq"):
            return None
        if entry.text_prefix != "model." and key.startswith(entry.text_prefix):
            return "model." + key[len(entry.text_prefix) :]
        return key

    return rename


def _check_weights(folder: Path, model: CausalLM, state: dict[str, Tensor]) -> None:
    expected = dict(model.state_dict())
    if model.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)  # tied: the embedding is the head, as in transformers
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if state[k].shape != expected[k].shape
    )
    if not (missing or unexpected or mismatched):
        return
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mismatched)):
        if names:
            shown = ", ".join(names[:_MAX_LISTED])
            more = f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
            parts.append(f"{len(names)} {label}: {shown}{more}")
    raise WeightMismatchError(
        f"checkpoint in {folder} does not match the model: " + "; ".join(parts),
        missing,
        unexpected,
        mismatched,
    )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _tokenizer_folder(path: str | Path) -> Path:
    """A tokenizer's folder: ``builtin:<name>``'s, or ``path`` itself (no config.json needed)."""
    if isinstance(path, str) and path.startswith(BUILTIN_PREFIX):
        return _resolve_folder(path)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TokenizerLoadError(f"tokenizer folder not found: {folder}")
    return folder


def _load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    # transformers 5 happily builds an EMPTY tokenizer from config.json alone: check first.
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerLoadError(
            f"cannot load a tokenizer from {folder}: none of {', '.join(_TOKENIZER_FILES)} found"
        )
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # transformers raises many types here; one typed error for callers
        raise TokenizerLoadError(f"cannot load a tokenizer from {folder}: {exc}") from exc


def _eos_token_ids(folder: Path, top_config: Any, text_config: Any, tokenizer: Any) -> list[int]:
    """Union, in priority order, of generation_config.json, the configs and the tokenizer's eos."""
    candidates: list[Any] = []
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        candidates.append(json.loads(gen_file.read_text()).get("eos_token_id"))
    candidates += [
        getattr(text_config, "eos_token_id", None),
        getattr(top_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ]
    ids: list[int] = []
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids
