"""The HTTP layer's bounds: a pool of handler threads, a deep listen backlog, bodies read only when declared and
within the limit, and "busy" answers instead of connection resets.

`PooledHTTPServer` is the stdlib's ThreadingHTTPServer with three changes. Its listen backlog is 1024 (the
stdlib's 5 let a burst of 500 clients time out or be reset). At most `workers` threads handle requests; up to
`queued` more accepted connections wait for one; beyond that a connection is answered 503 with Retry-After by
one separate thread (so the accept loop never waits on a client), and only when that thread is behind too is a
connection closed unanswered. A connection left silent for the handler's timeout is closed (an idle
keep-alive or a slow client cannot hold a worker for ever).
"""

from __future__ import annotations

import collections
import json
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from cohort.serving.limits import RequestError

RETRY_AFTER_S = 1
_HEAD_BYTES = 1 << 16  # a request head the busy answer reads (and drops) before answering


def _busy_response() -> bytes:
    body = json.dumps({"error": {"message": "cohort serve is busy: every worker is taken and the queue is full; "
                                            f"retry after {RETRY_AFTER_S} s", "type": "server_busy", "param": None,
                                 "code": "busy"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: {RETRY_AFTER_S}"
            f"\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def linger(sock: socket.socket, max_bytes: int, seconds: float) -> None:
    """Before closing a connection whose request was not read whole: end our side, then read and drop what the
    client still sends (at most `max_bytes`, `seconds`), so closing does not reset the connection under the
    answer (a client still sending would otherwise never read it)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + seconds
        while max_bytes > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            chunk = sock.recv(min(max_bytes, 1 << 16))
            if not chunk:
                return
            max_bytes -= len(chunk)
    except OSError:
        return


class _Refuser:
    """Answers the connections the pool has no room for with 503 + Retry-After, one at a time on its own thread;
    beyond `backlog` waiting ones a connection is closed unanswered (the server is far behind)."""

    def __init__(self, backlog: int = 256) -> None:
        self.backlog = backlog
        self.refused = 0
        self._waiting: collections.deque[socket.socket] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def refuse(self, sock: socket.socket) -> None:
        with self._cond:
            self.refused += 1
            if len(self._waiting) >= self.backlog:
                sock.close()
                return
            self._waiting.append(sock)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cohort-http-busy", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._waiting))
                sock = self._waiting.popleft()
            try:
                self._answer(sock)
            finally:
                sock.close()

    @staticmethod
    def _answer(sock: socket.socket) -> None:
        try:
            sock.settimeout(0.5)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < _HEAD_BYTES:
                chunk = sock.recv(_HEAD_BYTES)
                if not chunk:
                    break
                head += chunk
            sock.sendall(_busy_response())
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            while sock.recv(_HEAD_BYTES):  # what already arrived (a body): dropped, so closing sends no reset
                pass
        except OSError:  # timed out, nothing more waiting, or the client left: close
            return


class PooledHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a 1024-deep listen backlog, at most `workers` handler threads and at most `queued`
    accepted connections waiting for one (more: 503 + Retry-After)."""

    request_queue_size = 1024
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, *, workers: int = 64, queued: int = 1024) -> None:
        if workers < 1 or queued < 0:
            raise ValueError(f"workers={workers} must be >= 1 and queued={queued} >= 0")
        self.workers, self.queued = workers, queued
        self.refuser = _Refuser()
        self._jobs: collections.deque[tuple[Any, Any]] = collections.deque()
        self._pool = threading.Condition()
        self._idle = 0
        self._started = 0
        self._closed = False
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Called by the accept loop: hand the connection to a worker (starting one while fewer than `workers`
        run), queue it, or answer it 503."""
        with self._pool:
            if self._started >= self.workers and len(self._jobs) >= self.queued + self._idle:
                busy = True
            else:
                busy = False
                self._jobs.append((request, client_address))
                if len(self._jobs) > self._idle and self._started < self.workers:
                    self._started += 1
                    threading.Thread(target=self._work, name=f"cohort-http-{self._started}", daemon=True).start()
                self._pool.notify()
        if busy:
            self.refuser.refuse(request)

    def _work(self) -> None:
        while True:
            with self._pool:
                self._idle += 1
                self._pool.wait_for(lambda: bool(self._jobs) or self._closed)
                self._idle -= 1
                if self._closed:
                    return
                request, client_address = self._jobs.popleft()
            self.process_request_thread(request, client_address)  # handles, then closes the connection

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line, not a traceback, for a connection that failed outside a route (reset, malformed)."""
        error = sys.exc_info()[1]
        print(f"cohort serve: connection from {client_address[0]}: {type(error).__name__}: {error}",
              file=sys.stderr, flush=True)

    def server_close(self) -> None:
        super().server_close()
        with self._pool:
            self._closed = True
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._pool.notify_all()
        for request, _ in jobs:
            self.shutdown_request(request)


# ---- the request body ----------------------------------------------------------------------------------


def content_length(headers: Any, limit: int) -> int:
    """The declared body size, checked before any byte of the body is read: 411 when missing (or chunked),
    400 when not a non-negative integer or given twice, 413 when above `limit`."""
    if headers.get("Transfer-Encoding"):
        raise RequestError("Transfer-Encoding is not supported by cohort serve; send the body with a "
                           "Content-Length", status=411)
    values = headers.get_all("Content-Length") or []
    if not values:
        raise RequestError("a POST needs a Content-Length header (the body's size in bytes)", status=411)
    if len(set(values)) > 1:
        raise RequestError(f"Content-Length given {len(values)} times with different values", status=400)
    value = values[0].strip()
    if not (value.isascii() and value.isdigit()):
        raise RequestError(f"Content-Length={value[:40]!r} is not a size in bytes (a non-negative integer)")
    if len(value) > 18 or int(value) > limit:
        raise RequestError(f"the body has {value} bytes, more than this server's limit of {limit} "
                           f"({limit / (1 << 20):g} MiB, --max-body-mb); send a smaller request", status=413)
    return int(value)


def read_body(rfile: Any, length: int) -> bytes:
    """Exactly `length` bytes of body (408 when the client stops sending for the handler's timeout, 400 when the
    connection ends first)."""
    try:
        data = rfile.read(length)
    except TimeoutError:
        raise RequestError("the body did not arrive in time (the connection was silent for the server's read "
                           "timeout); send the whole body at once", status=408) from None
    if len(data) != length:
        raise RequestError(f"the body ended after {len(data)} of the {length} bytes its Content-Length declared")
    return data
