"""deltaserve: a continuous-batching inference engine for hybrid Gated DeltaNet + attention LLMs.

The public API::

    from deltaserve import AsyncEngine, EngineConfig, SamplingParams, RequestOutput

    config = EngineConfig.load("examples/serve.toml")      # every key: docs/config.md
    async with AsyncEngine(config) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")                         # out: a RequestOutput delta

plus the error types (``DeltaServeError`` and its subclasses ``ConfigError``,
``InvalidRequestError``, ``PromptTooLongError``, ``GrammarTimeoutError``, ``EngineOverloadedError``,
``EngineDeadError``) and ``install_uvloop``. A multi-turn chat that passes token ids back
so each turn reuses the cache: ``examples/chat.py``.

The source folders sit at the top of the repository (``engine/``, ``scheduler/``,
``cache/``, ``kernels/``, ``models/``, ``tools/``) and install as subpackages of this one
(``deltaserve.engine``, ``deltaserve.cache``, ...; see ``[tool.setuptools.package-dir]`` in
``pyproject.toml``), so an application's own ``models.py``, ``engine.py`` or ``cache/``
never clashes with ours. Torch-heavy names (``AsyncEngine``, ``EngineCore``) load on first
use: ``deltaserve.EngineConfig`` and the cache simulator import no torch.

The library never configures logging and never writes to stdout: it logs through the
standard ``logging`` module under the ``deltaserve`` logger (``deltaserve.logs``), which
the application configures; ``logging.level`` in the config sets that logger's level.
``deltaserve.logs.configure_logging(level)`` is a helper (one stderr handler) the tools use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

# In a source tree (an editable install, or a checkout on sys.path) the subpackages are the
# folders beside this one: resolve them from *this* tree, so a second checkout (a git
# worktree, a copy on another machine) runs its own code, not the installed one's. An
# installed wheel has them inside this folder and is left alone.
_here = Path(__file__).resolve().parent
if not (_here / "engine").is_dir() and (_here.parent / "engine" / "config.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821 (the package's module search path)

from deltaserve.engine import (  # noqa: E402
    ConfigError,
    DeltaServeError,
    EngineConfig,
    EngineDeadError,
    EngineOverloadedError,
    GrammarTimeoutError,
    InvalidRequestError,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
)

if TYPE_CHECKING:
    from deltaserve.engine import AsyncEngine, EngineCore, install_uvloop

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("AsyncEngine", "EngineCore", "install_uvloop"):
        import deltaserve.engine

        return getattr(deltaserve.engine, name)
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")


__all__ = [
    "AsyncEngine",
    "ConfigError",
    "DeltaServeError",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "EngineOverloadedError",
    "GrammarTimeoutError",
    "InvalidRequestError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "install_uvloop",
]
