"""The engine fixtures (built-in tiny model, ``core_factory``) for the cache tests that run a
real engine (``test_kv_events.py``)."""

from tests.engine.conftest import core_factory, tiny_loaded, tiny_path  # noqa: F401
