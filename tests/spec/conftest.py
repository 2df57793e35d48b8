"""The engine tests' fixtures (the built-in tiny model, engine factories) for the
speculative-decoding tests."""

from tests.engine.conftest import core_factory, hf_tiny, tiny_loaded, tiny_path  # noqa: F401
