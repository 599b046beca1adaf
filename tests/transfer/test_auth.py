"""Sealed side-channel frames (``transfer/auth.py``): a frame is read only if it carries
the shared secret's tag over exactly these bytes, is fresh, and was not read before."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.config import ConfigError
from vllm_dcp2d.transfer import auth as auth_mod
from vllm_dcp2d.transfer.auth import ENV, Auth, AuthError, PeerLog, load_secret
from vllm_dcp2d.transfer.messages import QueryRanks, Reply, encode

SECRET = b"s" * 32


def test_a_sealed_frame_opens_once_with_the_same_secret():
    a, b = Auth(SECRET), Auth(SECRET)
    frame = a.pack(QueryRanks("decode-1"))
    assert frame[:1] == b"\xc1"  # never a msgpack message
    assert b.unpack(frame, QueryRanks) == QueryRanks("decode-1")
    with pytest.raises(AuthError, match="replayed"):
        b.open(frame)
    with pytest.raises(AuthError, match="wrong authentication tag"):
        Auth(b"t" * 32).open(a.seal(b"x"))
    assert b.take_refused() == 1 and b.take_refused() == 0


@settings(max_examples=200)
@given(body=st.binary(max_size=300), at=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_changed_bit_is_refused(body, at, bit):
    frame = bytearray(Auth(SECRET).seal(body))
    frame[at % len(frame)] ^= 1 << bit
    with pytest.raises(AuthError):
        Auth(SECRET).open(bytes(frame))


@given(cut=st.integers(1, 60))
def test_a_truncated_frame_is_refused(cut):
    frame = Auth(SECRET).seal(encode(Reply(True, "")))
    with pytest.raises(AuthError):
        Auth(SECRET).open(frame[:-cut])


def test_unsealed_and_stale_frames_are_refused(monkeypatch):
    plain = encode(QueryRanks("x"))
    with pytest.raises(AuthError, match="unauthenticated frame was dropped"):
        Auth(SECRET).open(plain)
    with pytest.raises(AuthError, match="no auth secret"):
        Auth().open(Auth(SECRET).seal(plain))
    assert Auth().open(plain) == plain  # no secret: plain frames as before
    old = Auth(SECRET).seal(plain)
    real = auth_mod.time.time_ns
    monkeypatch.setattr(auth_mod.time, "time_ns", lambda: real() + int(61e9))
    with pytest.raises(AuthError, match="away from this host's clock"):
        Auth(SECRET).open(old)


def test_replays_stay_refused_when_the_nonce_memory_is_full(monkeypatch):
    """Past MAX_NONCES the oldest nonces are forgotten and the window's floor rises past
    them: a frame whose nonce was forgotten is refused all the same."""
    monkeypatch.setattr(auth_mod, "MAX_NONCES", 8)
    sender, receiver = Auth(SECRET), Auth(SECRET)
    frames = [sender.seal(b"%d" % i) for i in range(20)]
    for f in frames:
        receiver.open(f)
    for f in frames:
        with pytest.raises(AuthError, match="replayed"):
            receiver.open(f)


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert load_secret("") is None
    f = tmp_path / "secret"
    f.write_bytes(b"x" * 31 + b"\n")
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0644 lets other users read the secret.*chmod 600"):
        load_secret(str(f))
    f.chmod(0o600)
    key = load_secret(str(f))
    assert len(key) == 32 and b"x" * 31 not in key  # derived: the file's bytes are not the key
    f.write_bytes(b"short")
    with pytest.raises(ConfigError, match="has 5 bytes; expected at least 16"):
        load_secret(str(f))
    with pytest.raises(ConfigError, match="cannot read it"):
        load_secret(str(tmp_path / "missing"))
    monkeypatch.setenv(ENV, "y" * 20)
    from_env = load_secret("")
    assert len(from_env) == 32 and from_env != key and b"y" * 20 not in from_env


def test_peer_text_is_logged_clipped_and_at_most_once_per_interval(caplog):
    peers = PeerLog(logging.getLogger("test-peer-log"), every_s=60.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(1000):
            peers.warn("k", "got %s", "z" * 100_000)
    assert len(caplog.records) == 1 and len(caplog.records[0].getMessage()) < 400
