"""The proxy's upstream failures and how they reach the client (``app``)."""

from __future__ import annotations

import json

from aiohttp import web


class UpstreamError(Exception):
    """An upstream call that failed. ``status``: what the client gets; ``stage``/``kind``:
    the ``errors_total`` labels; ``retryable``: another instance of the stage's kind may
    take the call (nothing reached the client, and the call is safe to repeat)."""

    def __init__(self, status: int, message: str, body: dict | None = None, *, stage: str = "proxy",
                 kind: str = "bad_answer", retryable: bool = False):
        super().__init__(message)
        self.status, self.stage, self.kind, self.retryable = status, stage, kind, retryable
        self.body = body or {"error": {"message": message, "type": "upstream_error", "code": status}}


def upstream_status(kind: str, url: str, status: int, raw: bytes) -> UpstreamError:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    text = raw[:500].decode(errors="replace")
    if 400 <= status < 500:
        return UpstreamError(status, f"{kind} {url} rejected the request ({status}): {text}",
                             body if isinstance(body, dict) else None, stage=kind, kind="http_4xx")
    # a decode that failed before streaming may be dead or broken: another may serve it
    return UpstreamError(502, f"{kind} {url} failed ({status}): {text}", stage=kind, kind="http_5xx",
                         retryable=kind == "decode")


def error_response(status: int, message: str, type_: str = "proxy_error") -> web.Response:
    """An error of the proxy's own, in the shape of vLLM's (a client's 4xx as ``BadRequestError``)."""
    return web.json_response({"error": {"message": message, "type": type_, "param": None, "code": status}},
                             status=status)
