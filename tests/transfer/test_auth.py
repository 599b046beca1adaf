"""Sealed side-channel frames (``transfer/auth.py``): a frame is read only if it carries
the shared secret's tags over exactly these bytes, is sealed for the party reading it,
is no longer than what that party takes, is fresh, and was not read before; and what it
costs to refuse one is its head's hash, whatever its length."""

from __future__ import annotations

import logging
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.transfer import CountingHmac
from vllm_dcp2d.config import ConfigError
from vllm_dcp2d.transfer import auth as auth_mod
from vllm_dcp2d.transfer.auth import (BOOTSTRAP, ENV, Auth, AuthError, PeerLog, exposed, frame_limit, load_secret,
                                      rank_name)
from vllm_dcp2d.transfer.messages import (MAX_BYTES, MAX_MESSAGE_BYTES, CancelTransfer, QueryRanks, Reply,
                                           TransferRequest, encode)

SECRET = b"s" * 32
ME = rank_name("P", 0)
BIG = MAX_MESSAGE_BYTES


def test_a_sealed_frame_opens_once_with_the_same_secret():
    a, b = Auth(SECRET), Auth(SECRET)
    frame = a.pack(QueryRanks("decode-1", "q"), to=BOOTSTRAP)
    assert frame[:1] == b"\xc1"  # never a msgpack message
    assert b.unpack(frame, QueryRanks, me=BOOTSTRAP) == QueryRanks("decode-1", "q")
    with pytest.raises(AuthError, match="replayed"):
        b.open(frame, me=BOOTSTRAP, limit=BIG)
    with pytest.raises(AuthError, match="wrong authentication tag"):
        Auth(b"t" * 32).open(a.seal(b"x", to=ME), me=ME, limit=BIG)
    assert b.take_refused() == 1 and b.take_refused() == 0


def test_a_frame_sealed_for_one_party_is_refused_by_any_other():
    """Round 3, finding 2: a frame sealed for prefill cp rank 0 was read by cp rank 1, or
    by another instance's rank 0, if replayed there within 60 s; so was a rank table by a
    decode that asked another address. Its recipient is in the tag now, and named."""
    a = Auth(SECRET)
    frame = a.seal(b"x", to=rank_name("P", 0))
    for other in (rank_name("P", 1), rank_name("Q", 0), b"dcp2d-" + bytes(16)):
        with pytest.raises(AuthError, match="a frame sealed for b'P cp rank 0' was dropped by"):
            Auth(SECRET).open(frame, me=other, limit=BIG)
    assert Auth(SECRET).open(frame, me=rank_name("P", 0), limit=BIG) == b"x"
    table = a.seal(b"t", to="tcp://10.0.0.1:5000 query 00aa")
    with pytest.raises(AuthError, match="sealed for b'tcp://10.0.0.1:5000 query 00aa'"):
        Auth(SECRET).open(table, me="tcp://10.0.0.2:5000 query 00aa", limit=BIG)


@pytest.mark.parametrize("kind", ["junk", "other recipient", "replay", "stale"])
def test_a_long_frame_is_refused_after_hashing_its_head_only(kind, monkeypatch):
    """Round 3, finding 3: a 16 MiB frame of junk behind the magic bytes was hashed in full
    on a rank's I/O thread (73-79 ms each on the reviewer's host). Junk, a frame for
    another party, a replayed or a stale one are refused after a hash of the head (a few
    dozen bytes); a frame with a good head spends its nonce before its body is hashed, so
    a body changed in flight is hashed once at most."""
    body = bytes(16 << 20)
    sender, receiver = Auth(SECRET), Auth(SECRET)
    frame = sender.seal(body, to=ME)
    real = auth_mod.time.time_ns
    if kind == "junk":
        frame = frame[:4] + bytes(len(frame) - 4)
    elif kind == "replay":
        assert receiver.open(frame, me=ME, limit=BIG) == body
    elif kind == "stale":
        monkeypatch.setattr(auth_mod.time, "time_ns", lambda: real() + int(61e9))
    me = rank_name("P", 1) if kind == "other recipient" else ME
    counting = CountingHmac(auth_mod.hmac)
    monkeypatch.setattr(auth_mod, "hmac", counting)
    took = []
    for _ in range(5):  # each refused the same way; the fastest, so a busy host does not count
        t0 = time.perf_counter()
        with pytest.raises(AuthError):
            receiver.open(frame, me=me, limit=BIG)
        took.append(time.perf_counter() - t0)
    assert counting.hashed and max(counting.hashed) < 64, counting.hashed
    assert min(took) < 0.001, f"refusing a 16 MiB frame took {min(took) * 1e3:.1f} ms (one HMAC of it: ~15 ms)"


def test_a_body_changed_in_flight_is_hashed_once_then_its_head_is_spent(monkeypatch):
    frame = bytearray(Auth(SECRET).seal(bytes(1 << 20), to=ME))
    frame[100] ^= 1  # in the body: the head's tag is still right
    receiver, counting = Auth(SECRET), CountingHmac(auth_mod.hmac)
    monkeypatch.setattr(auth_mod, "hmac", counting)
    with pytest.raises(AuthError, match="wrong authentication tag"):
        receiver.open(bytes(frame), me=ME, limit=BIG)
    with pytest.raises(AuthError, match="replayed"):
        receiver.open(bytes(frame), me=ME, limit=BIG)
    assert sorted(counting.hashed)[-1] > 1 << 20 and sorted(counting.hashed)[-2] < 64  # one body hash in all


def test_a_frame_past_what_its_socket_takes_is_refused_before_hashing(monkeypatch):
    """Each socket reads at most the largest message it takes (``messages.MAX_BYTES``): a
    bootstrap or a decode rank small ones; checked on the frame's length, before any hash,
    and with or without a secret."""
    limit = MAX_BYTES[CancelTransfer]
    assert limit < 4096 and MAX_BYTES[TransferRequest] <= MAX_MESSAGE_BYTES
    assert frame_limit(CancelTransfer) < 16 << 10
    receiver = Auth(SECRET)
    sealed = Auth(SECRET).seal(bytes(limit + 1), to=ME)  # a secret holder's, one byte too long
    counting = CountingHmac(auth_mod.hmac)
    monkeypatch.setattr(auth_mod, "hmac", counting)
    n = limit + auth_mod.SEAL_BYTES + 1
    with pytest.raises(AuthError, match=f"a sealed frame of {n} bytes was dropped unread"):
        receiver.open(b"\xc1D2A" + bytes(n - 4), me=ME, limit=limit)
    with pytest.raises(AuthError, match=f"a frame of {limit + 1} bytes was dropped unread: what arrives here is at "
                                        f"most {limit}"):
        Auth().open(bytes(limit + 1), me=ME, limit=limit)
    assert counting.hashed == []
    with pytest.raises(AuthError, match="dropped unread"):
        receiver.open(sealed, me=ME, limit=limit)
    assert max(counting.hashed) < 64


@settings(max_examples=200)
@given(body=st.binary(max_size=300), at=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_changed_bit_is_refused(body, at, bit):
    frame = bytearray(Auth(SECRET).seal(body, to=ME))
    frame[at % len(frame)] ^= 1 << bit
    with pytest.raises(AuthError):
        Auth(SECRET).open(bytes(frame), me=ME, limit=BIG)


@given(cut=st.integers(1, 60))
def test_a_truncated_frame_is_refused(cut):
    frame = Auth(SECRET).seal(encode(Reply(True, "")), to=ME)
    with pytest.raises(AuthError):
        Auth(SECRET).open(frame[:-cut], me=ME, limit=BIG)


def test_unsealed_and_stale_frames_are_refused(monkeypatch):
    plain = encode(QueryRanks("x", "x"))
    with pytest.raises(AuthError, match="unauthenticated frame was dropped"):
        Auth(SECRET).open(plain, me=BOOTSTRAP, limit=BIG)
    with pytest.raises(AuthError, match="no auth secret"):
        Auth().open(Auth(SECRET).seal(plain, to=BOOTSTRAP), me=BOOTSTRAP, limit=BIG)
    assert Auth().open(plain, me=BOOTSTRAP, limit=BIG) == plain  # no secret: plain frames as before
    old = Auth(SECRET).seal(plain, to=BOOTSTRAP)
    real = auth_mod.time.time_ns
    monkeypatch.setattr(auth_mod.time, "time_ns", lambda: real() + int(61e9))
    with pytest.raises(AuthError, match="away from this host's clock"):
        Auth(SECRET).open(old, me=BOOTSTRAP, limit=BIG)


def test_registrations_are_sealed_with_the_token_with_or_without_a_secret():
    """Round 3, finding 4: the registration token travelled in clear in RegisterRank when
    there was no secret. It is a key now: the frame holds no token, and one sealed with
    another token (or the secret alone) does not open."""
    for secret in (None, SECRET):
        seal = Auth(secret).registration("t0k3n")
        frame = seal.seal(b"register", to=BOOTSTRAP)
        assert b"t0k3n" not in frame and frame[:1] == b"\xc1"
        assert Auth(secret).registration("t0k3n").holds(frame)
        assert not Auth(secret).registration("other").holds(frame)
        assert not Auth(SECRET if secret is None else None).registration("t0k3n").holds(frame)
        with pytest.raises(AuthError, match="wrong authentication tag"):
            Auth(secret).registration("other").open(frame, me=BOOTSTRAP, limit=BIG)
        assert Auth(secret).registration("t0k3n").open(frame, me=BOOTSTRAP, limit=BIG) == b"register"
    assert not Auth(SECRET).holds(Auth(SECRET).registration("t0k3n").seal(b"x", to=BOOTSTRAP))


def test_no_secret_beyond_loopback_is_said_in_one_line():
    assert exposed(False, {"local_hostname": "127.0.0.1", "bootstrap_host": "localhost"}) == ""
    assert exposed(False, {"local_hostname": "::1"}) == ""
    assert exposed(True, {"local_hostname": "10.0.0.5"}) == ""
    line = exposed(False, {"local_hostname": "127.0.0.1", "bootstrap_host": "10.0.0.5"})
    assert "\n" not in line and "bootstrap_host='10.0.0.5'" in line and "local_hostname" not in line
    assert "no auth secret" in line and "docs/security.md" in line
    assert "host.example" in exposed(False, {"local_hostname": "host.example"})


def test_replays_stay_refused_when_the_nonce_memory_is_full(monkeypatch):
    """Past MAX_NONCES the oldest nonces are forgotten and the window's floor rises past
    them: a frame whose nonce was forgotten is refused all the same."""
    monkeypatch.setattr(auth_mod, "MAX_NONCES", 8)
    sender, receiver = Auth(SECRET), Auth(SECRET)
    frames = [sender.seal(b"%d" % i, to=ME) for i in range(20)]
    for f in frames:
        receiver.open(f, me=ME, limit=BIG)
    for f in frames:
        with pytest.raises(AuthError, match="replayed"):
            receiver.open(f, me=ME, limit=BIG)


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
