"""Units of the HTTP surface that need no server: the bearer key check, the config's repr, the
command line's shorthands and positional model."""

from __future__ import annotations

from deltaserve.server import auth
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
