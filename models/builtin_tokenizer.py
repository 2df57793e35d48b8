"""The built-in tiny models' tokenizer, without torch: the simulator and the workload tools
build the same token ids as the engine on a machine where no built-in model was built yet.

Contract:

* ``train_tokenizer()`` returns the byte-level BPE ``tokenizers.Tokenizer`` every built-in model
  ships (fixed corpus, deterministic training: the same ids on every machine);
  ``build_tokenizer()`` wraps it as the transformers fast tokenizer the model folders save.
* ``ensure_builtin_tokenizer(cache_dir=None) -> Path`` returns ``<models dir>/tokenizer-<version>``
  with that tokenizer's ``tokenizer.json`` and ``chat_template.jinja``, written once (a temporary
  sibling renamed into place) and reused. ``builtin_models_dir`` is where both it and the model
  folders live; ``builtin_model_dir(name)`` is a model's folder, the one place that names it.

Nothing here imports torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

BUILTIN_VERSION = "v2"
DEFAULT_BUILTIN = "tiny-qwen3.5"
BUILTIN_NAMES = ("tiny-qwen3", "tiny-qwen3-next", "tiny-qwen3.5")  # ``models/builtin.py`` builds each

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOKENIZER_VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation, spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_PARAGRAPHS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his clever daughter.",
    "Every morning she walked to the harbour, counted the boats, and wrote the weather in a little notebook.",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "You are a helpful assistant. Answer the question briefly and clearly, and explain your reasoning.",
    "The user asked: what is the capital of France? The assistant answered: the capital of France is Paris.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1,000,000 and 7 + 5 = 12.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
    "The engine schedules requests in batches, caches the prefix of every prompt, and streams tokens back.",
    "Linear attention keeps a fixed-size state for each head, while full attention keeps every key and value.",
    "She said, \"Don't worry, we'll be there soon.\" He replied, \"I can't wait; it's been a long day.\"",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.",
    "January, February, March, April, May, June, July, August, September, October, November, December.",
    "Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.",
    "The library opens at nine o'clock and closes at six; children may borrow up to five books.",
    "In the beginning there was nothing but a question, and then there was an answer, and then a story.",
)
_SUBJECTS = (
    "the cat",
    "a student",
    "my friend",
    "the teacher",
    "our team",
    "the computer",
    "this model",
    "she",
)
_VERBS = ("reads", "writes", "finds", "builds", "explains", "remembers", "learns", "shares")
_OBJECTS = (
    "a short story",
    "the answer",
    "new ideas",
    "every word",
    "the old map",
    "simple code",
    "the plan",
)
_ENDINGS = (".", "!", "?", " today.", " again.", " quickly.")
_ADJECTIVES = (
    "bright",
    "quiet",
    "famous",
    "curious",
    "gentle",
    "ancient",
    "tiny",
    "enormous",
    "modern",
    "strange",
)
_NOUNS = (
    "garden",
    "mountain",
    "river",
    "castle",
    "kitchen",
    "market",
    "station",
    "forest",
    "island",
    "museum",
)
_COMMON_WORDS = (
    "about above across after against along among around because before behind below beneath beside between "
    "beyond during except inside outside through toward without within always never often sometimes usually "
    "people world family government company problem program question system number country student history "
    "morning evening night weather picture language science nature money music letter window mother father "
    "brother sister children doctor animal bird flower summer winter spring autumn yesterday tomorrow together "
    "important different possible necessary beautiful wonderful difficult interesting comfortable dangerous "
    "working playing thinking running talking walking learning teaching building writing reading listening "
    "started finished wanted needed asked helped called opened closed moved lived loved played watched turned"
)
_PLACES = ("near the city", "behind the school", "across the valley", "under the bridge", "beside the lake")


def builtin_corpus() -> list[str]:
    """Fixed training text for the tokenizer (no randomness: enumeration order is the order)."""
    lines = list(_PARAGRAPHS)
    for i, subject in enumerate(_SUBJECTS):
        for j, verb in enumerate(_VERBS):
            for k, obj in enumerate(_OBJECTS):
                ending = _ENDINGS[(i + j + k) % len(_ENDINGS)]
                lines.append(f"{subject.capitalize()} {verb} {obj}{ending}")
    for i, adjective in enumerate(_ADJECTIVES):
        for j, noun in enumerate(_NOUNS):
            place = _PLACES[(i * 3 + j) % len(_PLACES)]
            lines.append(
                f"There is a {adjective} {noun} {place}, and people visit it in {_PARAGRAPHS[14].split(', ')[j]}."
            )
    words = _COMMON_WORDS.split()
    for i in range(0, len(words), 6):
        lines.append(" ".join(words[i : i + 6]).capitalize() + ".")
    for role, content in (
        ("system", "You are a helpful assistant."),
        ("user", "Hi!"),
        ("assistant", "Hello."),
    ):
        lines.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    return lines


def train_tokenizer() -> object:
    """Train the byte-level BPE tokenizer (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    return tok


def build_tokenizer() -> object:
    """The trained tokenizer as a transformers fast tokenizer (what the model folders save)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )


def builtin_models_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("DELTASERVE_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "deltaserve"
    return root / "models"


def check_builtin_name(name: str) -> None:
    """A ``ValueError`` naming the built-in models unless ``name`` is one of them."""
    if name not in BUILTIN_NAMES:
        raise ValueError(f"unknown builtin model {name!r}; available: {', '.join(sorted(BUILTIN_NAMES))}")


def builtin_model_dir(name: str = DEFAULT_BUILTIN, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of built-in model ``name`` (``models/builtin.py`` builds it there)."""
    return builtin_models_dir(cache_dir) / f"{name}-{BUILTIN_VERSION}"


def build_once(final: Path, write: Callable[[Path], None]) -> Path:
    """``final``, written once by ``write`` into a temporary sibling that is renamed into place
    (atomic; a concurrent builder that loses the race drops its copy), and reused when present."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # lost a race to a concurrent builder: theirs is as good
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_builtin_tokenizer(cache_dir: str | os.PathLike | None = None) -> Path:
    """``<models dir>/tokenizer-<version>``: the built-in tokenizer's ``tokenizer.json`` and chat
    template, built once (no model weights, no torch)."""

    def write(folder: Path) -> None:
        train_tokenizer().save(str(folder / "tokenizer.json"))  # type: ignore[attr-defined]
        (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    return build_once(builtin_models_dir(cache_dir) / f"tokenizer-{BUILTIN_VERSION}", write)
