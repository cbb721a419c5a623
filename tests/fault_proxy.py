"""An HTTP proxy in front of the real moto S3 server that injects store faults.

Clients (the real ``pyarrow`` S3 filesystem, in the test process, in spawned
gloo ranks and in Ray workers) use ``proxy.endpoint`` as their
``endpoint_override``; every request is forwarded to moto unchanged, except
the ones a rule picks. Rules match a request by method and by a regular
expression on its path and query, by default the backend's own checkpoint
objects (``.../checkpoint_000001/...``, not Ray's run files), and inject:

- ``throttle``: a fraction of the matching requests answered ``503
  SlowDown`` (seeded, so a run is repeatable);
- ``outage``: the first matching request starts an outage of ``seconds``;
  until it ends every matching request has its connection closed without an
  answer (what a client sees of a store that drops connections). With
  ``drops``, it lasts until at least that many requests were dropped, however
  long they take: a client's own retries outlast a timed outage on a loaded
  machine (each attempt slower), a count of them does not;
- ``drop_mid_body``: the next ``count`` matching uploads are cut after half
  of their body arrived (the connection closes, nothing reaches moto);
- ``deny``: matching requests answered ``403 AccessDenied``.

``injected`` counts what was injected, by kind. The process that started
the proxy configures it directly; other processes (spawned ranks, Ray
workers) through ``RemoteFaults(endpoint)``, which has the same rule methods
and sends them to the proxy over HTTP (``/_faults``, never forwarded).
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHECKPOINT_OBJECTS = r"/checkpoint_\d+/[^/?]+"
"""Objects inside checkpoint directories (not the directory markers, which
Ray writes too, nor Ray's run files beside them)."""
WRITES = ("PUT", "POST")
READS = ("GET", "HEAD")
SDK_ATTEMPTS = 3
"""Attempts ``pyarrow``'s S3 client makes per request by itself (its default
``AwsStandardS3RetryStrategy(max_attempts=3)``), about 2 s apart in all."""
LISTING = r"[?&]list-type=2"
"""A ListObjectsV2 request (how ``pyarrow`` lists a prefix)."""

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}
_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
)


@dataclass
class _Rule:
    kind: str
    methods: tuple[str, ...]
    pattern: re.Pattern
    fraction: float = 1.0
    seconds: float = 0.0
    count: int = -1  # -1: unlimited
    drops: int = 0  # an outage lasts until at least this many requests were dropped
    status: int = 503
    code: str = "SlowDown"
    until: float | None = None  # an outage in progress ends then
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and bool(self.pattern.search(path))


class FaultProxy:
    """The proxy, listening on a free loopback port; ``close()`` stops it."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.injected: dict[str, int] = {}
        self.requests = 0
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self
        self.port = self._server.server_address[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- rules -----------------------------------------------------------

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.injected.clear()

    def throttle(self, fraction, *, methods=WRITES, pattern=CHECKPOINT_OBJECTS, seed=0) -> None:
        self._add(_Rule("throttle", methods, re.compile(pattern), fraction=fraction,
                        rng=random.Random(seed)))  # fmt: skip

    def outage(
        self, seconds, *, methods=WRITES, pattern=CHECKPOINT_OBJECTS, count=1, drops=0
    ) -> None:
        """The first ``count`` matching requests each start (or extend) an
        outage of ``seconds`` for all matching requests; it lasts until at
        least ``drops`` of them were dropped."""
        rule = _Rule("outage", methods, re.compile(pattern), seconds=seconds, count=count)
        rule.drops = drops
        self._add(rule)

    def drop_mid_body(self, *, count=1, pattern=CHECKPOINT_OBJECTS) -> None:
        self._add(_Rule("drop_mid_body", WRITES, re.compile(pattern), count=count))

    def deny(self, *, methods=WRITES + READS + ("DELETE",), pattern=CHECKPOINT_OBJECTS) -> None:
        self._add(_Rule("deny", methods, re.compile(pattern), status=403, code="AccessDenied"))

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _decide(self, method: str, path: str, has_body: bool) -> _Rule | None:
        """The rule that faults this request, if any (counted)."""
        now = time.monotonic()
        with self._lock:
            self.requests += 1
            for rule in self._rules:
                if not rule.matches(method, path):
                    continue
                if rule.kind == "outage":
                    started = rule.until is not None
                    if started and (now < rule.until or rule.drops > 0):
                        rule.drops -= 1
                        return self._count(rule)
                    if rule.count != 0:
                        rule.count -= 1
                        rule.until = now + rule.seconds
                        rule.drops -= 1
                        return self._count(rule)
                elif rule.kind == "drop_mid_body":
                    if has_body and rule.count != 0:
                        rule.count -= 1
                        return self._count(rule)
                elif rule.kind == "throttle":
                    if rule.rng.random() < rule.fraction:
                        return self._count(rule)
                else:
                    return self._count(rule)
        return None

    def _count(self, rule: _Rule) -> _Rule:
        self.injected[rule.kind] = self.injected.get(rule.kind, 0) + 1
        return rule


_RULES = ("clear", "throttle", "outage", "drop_mid_body", "deny")
_CONTROL = "/_faults"


class RemoteFaults:
    """A proxy's rules set from another process: ``RemoteFaults(endpoint).
    outage(3, methods=READS)``; ``injected()`` reads its counters."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def _call(self, method: str, body: dict | None = None):
        host, port = self.endpoint.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request(method, _CONTROL, body=json.dumps(body) if body else None)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def injected(self) -> dict[str, int]:
        return self._call("GET")

    def __getattr__(self, name: str):
        if name not in _RULES:
            raise AttributeError(name)
        return lambda *args, **kwargs: self._call(
            "POST", {"rule": name, "args": args, "kwargs": kwargs}
        )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

    def log_message(self, *args) -> None:  # quiet
        pass

    def _proxy(self) -> None:
        proxy: FaultProxy = self.server.proxy
        length = int(self.headers.get("Content-Length") or 0)
        if self.path == _CONTROL:
            self._control(proxy, self.rfile.read(length))
            return
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        rule = proxy._decide(self.command, self.path, length > 0 or chunked)
        if rule is not None and rule.kind in ("outage", "drop_mid_body"):
            if rule.kind == "drop_mid_body":
                self.rfile.read(length // 2)
            self._drop()
            return
        body = self._read_chunked() if chunked else self.rfile.read(length)
        if rule is not None:
            message = "Please reduce your request rate." if rule.status == 503 else "Access Denied"
            self._answer(rule.status, {"Content-Type": "application/xml"},
                         _ERROR_XML.format(code=rule.code, message=message).encode())  # fmt: skip
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if chunked:
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            response = conn.getresponse()
            data = response.read()
            out = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
        finally:
            conn.close()
        if self.command != "HEAD":
            out["Content-Length"] = str(len(data))
        self._answer(response.status, out, data)

    def _control(self, proxy: FaultProxy, body: bytes) -> None:
        if self.command == "POST":
            call = json.loads(body)
            for key in ("methods",):  # JSON turns tuples into lists
                if key in call["kwargs"]:
                    call["kwargs"][key] = tuple(call["kwargs"][key])
            getattr(proxy, call["rule"])(*call["args"], **call["kwargs"])
        with proxy._lock:
            answer = json.dumps(proxy.injected).encode()
        self._answer(200, {"Content-Type": "application/json"}, answer)

    def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def _answer(self, status: int, headers: dict, body: bytes) -> None:
        self.send_response_only(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers and self.command != "HEAD":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _drop(self) -> None:
        """Close the connection without an answer."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _proxy
