"""Membership in vLLM's router by its service discovery (opt-in: ``router_discovery_address``).

``vllm-router --vllm-pd-disaggregation --vllm-discovery-address HOST:PORT`` (the
vllm-project router, ``src/routers/http/vllm_service_discovery.rs``) binds a ZMQ
ROUTER socket there, takes no ``--prefill``/``--decode`` list, and routes only to
instances that registered within the last 5 seconds. A registration is one msgpack
map, ``{"type": "P" | "D", "http_address": "host:port", "zmq_address": "..."}``;
there is no message to leave: an instance leaves by falling silent.

TP rank 0 of an instance sends its registration every ``PING_S`` while the
instance's own API server answers ``GET /health``: the router then never picks an
instance whose engine is up but whose HTTP server is not yet (or no longer)
listening. A ``kv_both`` instance registers as both kinds. Sends never block (ZMQ
``IMMEDIATE``: with no connection to the router, a registration is dropped, not
queued to arrive stale).
"""

from __future__ import annotations

import logging
import threading
import urllib.error

import msgpack
import zmq

from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.http_bootstrap import direct_get

__all__ = ["PING_S", "Registration", "registration"]

log = logging.getLogger(__name__)

PING_S = 2.0  # the router forgets an instance 5 s after its last registration: two may be lost
HEALTH_TIMEOUT_S = 1.0


def healthy(http_address: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether ``http://http_address/health`` answers 200 within ``timeout_s``."""
    try:
        with direct_get(f"http://{http_address}/health", timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Registration:
    """Registers ``http_address`` as ``kinds`` (of "P", "D") with the router listening on
    ``router`` ("host:port"), every ``ping_s`` while ``healthy(http_address)``, until
    ``close()``. ``sent``: registrations handed to ZMQ; ``skipped``: pings not sent
    because the API server did not answer."""

    def __init__(self, router: str, http_address: str, kinds: tuple[str, ...], zmq_address: str,
                 ping_s: float = PING_S):
        bad = [k for k in kinds if k not in ("P", "D")]
        if not kinds or bad:
            raise ValueError(f"kinds {kinds!r}: expected one or both of 'P', 'D'")
        self.router, self.http_address, self.ping_s = router, http_address, ping_s
        self._payloads = [msgpack.packb({"type": k, "http_address": http_address, "zmq_address": zmq_address})
                          for k in kinds]
        self.sent = self.skipped = 0
        self._sock = sockets.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDHWM, 4)
        try:
            self._sock.connect(f"tcp://{router}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"router_discovery_address {router!r}: ZMQ cannot connect to it ({e}); "
                             "expected the host:port vllm-router's --vllm-discovery-address listens on") from e
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dcp2d-router-registration", daemon=True)
        self._thread.start()
        log.info("registering %s as %s with vllm-router at %s every %.1f s while it answers /health",
                 http_address, "+".join(kinds), router, ping_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if healthy(self.http_address, min(HEALTH_TIMEOUT_S, self.ping_s)):
                for payload in self._payloads:
                    if sockets.send_nowait(self._sock, payload):
                        self.sent += 1
            else:
                self.skipped += 1
            self._stop.wait(self.ping_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop registering; the router drops this instance 5 s after the last one."""
        self._stop.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._sock.close()


def registration(cfg, is_producer: bool, is_consumer: bool) -> Registration | None:
    """The instance's ``Registration`` per ``cfg`` (None when ``router_discovery_address``
    is empty); started by TP rank 0 once its transfer path is up. The router only
    logs ``zmq_address`` and puts it in its request ids: a prefill gives its bootstrap
    server's address, a decode its HTTP address."""
    if not cfg.router_discovery_address:
        return None
    kinds = (("P",) if is_producer else ()) + (("D",) if is_consumer else ())
    zmq_address = f"{cfg.bootstrap_host}:{cfg.bootstrap_port}" if is_producer else cfg.router_http_address
    return Registration(cfg.router_discovery_address, cfg.router_http_address, kinds, zmq_address)
