"""The strict wire codec under ``messages``: field codecs that check every value
read from the network, and the map <-> message-object conversion.

``messages.py`` holds the message types (each one's ``SCHEMA`` maps its fields
to the codecs here), the protocol version and ``encode``/``decode``; this
module holds what a schema is made of. No I/O. A field codec has
``enc(value) -> wire`` and ``dec(wire, name) -> value``; ``dec`` raises
``MessageError`` naming the field, the expected type or range and the value;
``bound``: the most msgpack bytes a value it accepts can take (``schema_bound``
adds a schema's up, so every message type has a known largest size).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["MessageError", "FingerprintMismatch", "MAX_ADDR", "Str", "Int", "Float", "Bool", "Ids", "StrList",
           "Nested", "fields_to_wire", "fields_from_wire", "schema_bound"]

MAX_ADDR = (1 << 63) - 1


class MessageError(ValueError):
    """A message that cannot be accepted: malformed, hostile, or another version."""


class FingerprintMismatch(MessageError):
    """The two sides disagree on the KV format; the message names both values."""


# msgpack's largest headers: a str, bin, array or map header takes at most 5 bytes, an
# int or a float at most 9 (a 1-byte type and 8 bytes of value).
_HEAD, _NUM = 5, 9


class Str:
    def __init__(self, max_len: int, min_len: int = 1):
        self.min_len, self.max_len = min_len, max_len
        self.bound = _HEAD + 4 * max_len  # UTF-8: at most 4 bytes per character

    def enc(self, v):
        return str(v)

    def dec(self, v, name):
        if type(v) is not str:
            raise MessageError(f"{name} must be a string, got {type(v).__name__}")
        if not self.min_len <= len(v) <= self.max_len:
            raise MessageError(f"{name} must have {self.min_len}..{self.max_len} characters, got {len(v)}")
        return v


class Int:
    bound = _NUM

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def enc(self, v):
        return int(v)

    def dec(self, v, name):
        if type(v) is not int:
            raise MessageError(f"{name} must be an int, got {type(v).__name__}")
        if not self.lo <= v <= self.hi:
            raise MessageError(f"{name} must be in [{self.lo}, {self.hi}], got {v}")
        return v


class Float:
    bound = _NUM

    def __init__(self, hi: float):
        self.hi = hi

    def enc(self, v):
        return float(v)

    def dec(self, v, name):
        if type(v) is not float or not math.isfinite(v) or not 0.0 <= v <= self.hi:
            raise MessageError(f"{name} must be a float in [0, {self.hi}], got {v!r}")
        return v


class Bool:
    bound = 1

    def enc(self, v):
        return bool(v)

    def dec(self, v, name):
        if type(v) is not bool:
            raise MessageError(f"{name} must be a bool, got {type(v).__name__}")
        return v


class Ids:
    """int64 ``[n]`` array as little-endian ``bin``; every entry in ``[lo, hi]``."""

    def __init__(self, max_n: int, lo: int = 0, hi: int = MAX_ADDR, min_n: int = 0):
        self.min_n, self.max_n, self.lo, self.hi = min_n, max_n, lo, hi
        self.bound = _HEAD + 8 * max_n

    def enc(self, v):
        return np.ascontiguousarray(np.asarray(v, dtype=np.int64).reshape(-1), dtype="<i8").tobytes()

    def dec(self, v, name):
        if type(v) is not bytes:
            raise MessageError(f"{name} must be bin (int64 array), got {type(v).__name__}")
        if len(v) % 8:
            raise MessageError(f"{name} holds {len(v)} bytes, not a multiple of 8 (int64)")
        arr = np.frombuffer(v, dtype="<i8").astype(np.int64)
        if not self.min_n <= arr.size <= self.max_n:
            raise MessageError(f"{name} must have {self.min_n}..{self.max_n} entries, got {arr.size}")
        if arr.size and (arr.min() < self.lo or arr.max() > self.hi):
            raise MessageError(f"{name} entries must be in [{self.lo}, {self.hi}], "
                               f"got min {arr.min()} max {arr.max()}")
        return arr


class StrList:
    def __init__(self, max_n: int, item: Str):
        self.max_n, self.item = max_n, item
        self.bound = _HEAD + max_n * item.bound

    def enc(self, v):
        return [self.item.enc(x) for x in v]

    def dec(self, v, name):
        if type(v) is not list or len(v) > self.max_n:
            raise MessageError(f"{name} must be a list of at most {self.max_n} strings")
        return tuple(self.item.dec(x, f"{name}[{i}]") for i, x in enumerate(v))


class Nested:
    def __init__(self, cls):
        self.cls = cls
        self.bound = schema_bound(cls)

    def enc(self, v):
        return fields_to_wire(v)

    def dec(self, v, name):
        return fields_from_wire(self.cls, v, name)


def schema_bound(cls) -> int:
    """The most msgpack bytes a map of ``cls.SCHEMA``'s fields can take once ``fields_from_wire``
    accepts it (each key, each value at its codec's ``bound``)."""
    return _HEAD + sum(_HEAD + len(k) + c.bound for k, c in cls.SCHEMA.items())


def fields_to_wire(msg) -> dict:
    """``msg``'s ``SCHEMA`` fields as a wire map."""
    return {k: c.enc(getattr(msg, k)) for k, c in msg.SCHEMA.items()}


def fields_from_wire(cls, raw, name: str):
    """An instance of message class ``cls`` from wire map ``raw``: exactly its
    ``SCHEMA`` fields, each decoded, then ``validate()``d; errors name ``name``."""
    if type(raw) is not dict:
        raise MessageError(f"{name} must be a map, got {type(raw).__name__}")
    keys = set(raw)
    want = set(cls.SCHEMA)
    if keys != want:
        missing, extra = sorted(want - keys), sorted(map(repr, keys - want))
        raise MessageError(f"{name} ({cls.__name__}): missing fields {missing}, unknown fields {extra}")
    msg = cls(**{k: c.dec(raw[k], f"{name}.{k}") for k, c in cls.SCHEMA.items()})
    msg.validate()
    return msg
