"""vLLM's MooncakeConnector bootstrap protocol, beside the ZMQ bootstrap: what routers
in Mooncake mode speak (vllm-router ``--kv-connector mooncake``, llm-d's ``mooncake``).

Such a router asks each prefill instance ``GET http://host:port/query`` at start-up
and expects vLLM's ``MooncakeBootstrapServer`` answer,
``{dp_rank: {"engine_id": ..., "worker_addr": {tp_rank: {pp_rank: addr}}}}``; it
then gives the decode ``remote_bootstrap_addr = "http://host:port"`` (and the
``"transfer_id"`` it also gave the prefill). So the prefill instance's TP rank 0 runs
:class:`HttpBootstrap` on ``http_bootstrap_port`` next to the ZMQ ``BootstrapServer``:
its answer has vLLM's shape (``worker_addr``: the CP ranks' side channels) plus a
``"dcp2d"`` entry, the ZMQ bootstrap's address and its rank table
(``messages.RankTable`` or, while ranks are missing, a ``Reply``), msgpack in
base64. A decode rank given an ``http://`` address reads the rank table from there
(:class:`HttpTableQuery`, the same interface as ``bootstrap.TableQuery``) and talks
to the CP ranks as usual. It asks with its ``QueryRanks`` in the ``QUERY_HEADER``
header (base64, sealed when there is a secret), and the rank table is the
``BootstrapServer``'s answer to it: sealed for that query, so a table the decode did
not ask this address for is refused. With a secret, a ``GET`` without a query that
opens gets a plain refusal in its place (routers need only vLLM's part).

Every request has a timeout; the server answers from memory and never blocks on a
peer. A connection is cut ``HTTP_TIMEOUT_S`` after it was accepted, whatever it sends
(a peer that sends a byte now and then holds its slot no longer), and one peer address
holds at most ``MAX_PER_PEER`` of the ``MAX_CONNECTIONS`` slots.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq

from vllm_dcp2d.transfer import bootstrap as bs
from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.auth import BOOTSTRAP, NO_AUTH, Auth
from vllm_dcp2d.transfer.messages import QueryRanks, RankTable, Reply, clip, encode

__all__ = ["HttpBootstrap", "HttpTableQuery", "check_http_addr", "direct_get", "start_http_bootstrap", "MAX_ANSWER",
           "QUERY_HEADER"]

log = logging.getLogger(__name__)
MAX_ANSWER = 1 << 20  # bytes of a /query answer a decode reads at most
HTTP_TIMEOUT_S = 5.0  # per connection, from accept to the last byte of the answer, and per GET
MAX_CONNECTIONS = 32  # connections served at once; more are closed at accept
MAX_PER_PEER = 16     # of them, from one peer address
QUERY_HEADER = "X-DCP2D-Query"  # a decode rank's QueryRanks, base64
_ADDR = re.compile(r"http://(?P<host>[A-Za-z0-9._\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})/?")
_ids = itertools.count()
# Peers are asked directly: urllib's default opener would send these GETs through
# $http_proxy, which on a cluster behind a proxy cannot reach the peer.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def direct_get(url: str, timeout_s: float, headers: dict | None = None):
    """``GET url`` never through a proxy; the response, as ``urllib.request.urlopen`` returns it."""
    return _DIRECT.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s)


def check_http_addr(addr) -> str:
    """``addr`` without a trailing slash if it is ``http://host:port`` with a port in
    [1, 65535]; raises ValueError naming the value and the form expected."""
    m = _ADDR.fullmatch(addr) if isinstance(addr, str) else None
    if m is None or not 1 <= int(m["port"]) <= 65535:
        raise ValueError(f"remote_bootstrap_addr = {addr!r}: expected 'http://<host>:<port>' with a port in "
                         f"[1, 65535]")
    return addr.rstrip("/")


class HttpBootstrap:
    """``GET /query`` of one prefill instance, answered from its ``BootstrapServer``.

    server: the instance's ZMQ ``bootstrap.BootstrapServer`` (same process; the rank
    table is sealed with its ``auth``); engine_id: the instance's engine id (the router
    passes it on as ``remote_engine_id``)."""

    def __init__(self, host: str, port: int, server: bs.BootstrapServer, engine_id: str):
        self.server, self.engine_id = server, engine_id
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = HTTP_TIMEOUT_S  # the connection's socket timeout: an idle or half-sent request ends

            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != "/query":
                    return self._send(404, {"error": f"no {self.path}; this is the DCP2D bootstrap: GET /query"})
                try:
                    return self._send(200, owner.answer(self.headers.get(QUERY_HEADER)))
                except Exception as e:  # noqa: BLE001 - a bug answers 500, the server goes on
                    log.exception("http bootstrap: /query failed")
                    return self._send(500, {"error": f"{type(e).__name__}: {e}"})

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet: a router polls this
                pass

        self._http = _BoundedServer((host, port), Handler)
        self.port = self._http.server_address[1]
        self.address = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": sockets.POLL_S},
                                        name=f"dcp2d-http-bootstrap-{self.port}", daemon=True)
        self._thread.start()

    def answer(self, query: str | None = None) -> dict:
        """vLLM's ``{dp_rank: {"engine_id", "worker_addr": {tp_rank: {pp_rank: addr}}}}`` for DP rank 0,
        plus ``"dcp2d": {"bootstrap", "rank_table"}``: the ``BootstrapServer``'s answer to
        ``query`` (the ``QUERY_HEADER``: a ``QueryRanks``, base64). Without one, the table
        in the clear if there is no secret, else a plain refusal."""
        ranks = self.server.ranks()
        if query is not None:
            try:
                frame = self.server.answer(base64.b64decode(query, validate=True))
            except ValueError as e:  # binascii.Error
                frame = encode(Reply(False, f"rejected: the {QUERY_HEADER} header is not base64: {e}"))
        elif self.server.auth.enabled:
            frame = encode(Reply(False, f"refused: this bootstrap answers its rank table to a sealed QueryRanks in "
                                        f"the {QUERY_HEADER} header only"))
        else:
            frame = encode(self.server.table())
        return {"0": {"engine_id": self.engine_id,
                      "worker_addr": {str(r): {"0": addr} for r, addr in ranks.items()},
                      "dcp2d": {"bootstrap": self.server.address, "rank_table": base64.b64encode(frame).decode()}}}

    def close(self, timeout_s: float = 5.0) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout_s)


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``MAX_CONNECTIONS`` of them and ``MAX_PER_PEER``
    from one peer address; the connections past either limit are closed at once. Each is
    cut ``HTTP_TIMEOUT_S`` after it was accepted, whatever it sent meanwhile (the serving
    loop checks every ``sockets.POLL_S``): a peer trickling a byte at a time holds a
    thread that long at most, and the peers of other addresses always have slots."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address, handler):
        self._lock = threading.Lock()
        self._open: dict[socket.socket, tuple[str, float]] = {}  # connection -> (peer address, deadline)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        peer = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        with self._lock:
            full = (len(self._open) >= MAX_CONNECTIONS
                    or sum(p == peer for p, _ in self._open.values()) >= MAX_PER_PEER)
            if not full:
                self._open[request] = (peer, time.monotonic() + HTTP_TIMEOUT_S)
        if full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._close(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._close(request)

    def service_actions(self):
        """Between polls of the listening socket: cut the connections past their deadline
        (their thread's read or write then ends, and it closes the connection)."""
        now = time.monotonic()
        with self._lock:
            late = [s for s, (_, deadline) in self._open.items() if deadline <= now]
        for s in late:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile

    def handle_error(self, request, client_address):
        # a connection cut at its deadline, or a peer gone mid-answer: nothing to report
        log.debug("http bootstrap: connection from %s ended early", client_address, exc_info=True)

    def _close(self, request) -> None:
        with self._lock:
            self._open.pop(request, None)


def start_http_bootstrap(cfg, server: bs.BootstrapServer, engine_id: str) -> HttpBootstrap | None:
    """The prefill's TP rank 0: an ``HttpBootstrap`` on ``cfg.http_bootstrap_port`` (a
    ``DCP2DConfig``), or by default on vLLM's ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` if that is
    free (a router in Mooncake mode is then given that port, as for vLLM's own connector)."""
    port = cfg.http_bootstrap_port
    if port == 0:
        return None
    default = port < 0
    if default:
        port = int(os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998"))
    try:
        http = HttpBootstrap(cfg.bootstrap_host, port, server, engine_id)
    except OSError as e:
        if not default:
            raise RuntimeError(f"kv_connector_extra_config['http_bootstrap_port'] = {port}: cannot serve on "
                               f"{cfg.bootstrap_host}:{port} ({e})") from e
        log.warning("DCP2D: no HTTP bootstrap (routers in Mooncake mode cannot reach this prefill): port %d "
                    "(VLLM_MOONCAKE_BOOTSTRAP_PORT) on %s is taken (%s); set http_bootstrap_port",
                    port, cfg.bootstrap_host, e)
        return None
    log.info("DCP2D producer: HTTP bootstrap (vLLM's Mooncake protocol, GET /query) on %s", http.address)
    return http


class HttpTableQuery(bs.RankTableQuery):
    """``bootstrap.RankTableQuery`` for an ``http://host:port`` bootstrap address:
    ``ask(now)`` starts one ``GET /query`` in a short-lived thread when one is due (the
    same resend schedule), whose answer arrives on ``.sock`` (a ZMQ PULL socket the loop
    polls); ``read()`` takes it. ``.monitor`` never fires (there is no connection to
    lose between queries)."""

    def __init__(self, address: str, engine_id: str, accept, auth: Auth = NO_AUTH):
        super().__init__(check_http_addr(address), engine_id, accept, auth)
        self._inproc = f"inproc://dcp2d-http-query-{next(_ids)}"
        self.sock = sockets.context().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self._inproc)
        self.monitor = sockets.context().socket(zmq.PAIR)  # polled like TableQuery's monitor; nothing writes it
        self.monitor.setsockopt(zmq.LINGER, 0)
        self._busy = threading.Event()  # a GET is in flight

    def ask(self, now: float) -> None:
        if self.table is not None or self._busy.is_set():
            return
        if not self._asked and now >= self._retry_at:
            self._asked = now
            self._busy.set()
            threading.Thread(target=self._get, name="dcp2d-http-query", daemon=True).start()

    def _get(self) -> None:
        """One ``GET /query`` (its own thread), asking with ``QUERY_HEADER``. Pushes ``b"T" + the
        sealed rank table`` or ``b"E" + why not``; whatever the peer answers (not HTTP, not
        JSON, too long), the query ends and ``_busy`` clears."""
        try:
            query = base64.b64encode(self.auth.pack(QueryRanks(self.engine_id, self.reply_to), to=BOOTSTRAP)).decode()
            with direct_get(self.address + "/query", HTTP_TIMEOUT_S, {QUERY_HEADER: query}) as r:
                body = json.loads(r.read(MAX_ANSWER + 1)[:MAX_ANSWER])
            entry = body["0"]["dcp2d"]
            frame = b"T" + base64.b64decode(entry["rank_table"], validate=True)
        except Exception as e:  # noqa: BLE001 - a peer's answer of any shape (http.client.HTTPException too)
            frame = b"E" + clip(f"GET {self.address}/query: {type(e).__name__}: {e}", 400).encode()
        push = sockets.context().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        try:
            push.connect(self._inproc)
            push.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the loop closed the query meanwhile
            log.debug("http bootstrap answer from %s dropped: %s", self.address, e)
        finally:
            push.close()
            self._busy.clear()

    def read(self) -> RankTable | None:
        frame = self.sock.recv()
        self._asked = 0.0
        if frame[:1] == b"E":  # no answer: again after the resend schedule's wait
            self.last_reason = frame[1:].decode(errors="replace")
            self._retry_at = time.monotonic() + self._backoff.next()
            return None
        return self._take(frame[1:])

    def close(self) -> None:
        self.sock.close()
        self.monitor.close()

