"""One HTTP exchange under one deadline: what gspo's clients of servers (vLLM's, a judge's) share.

    status, raw = exchange("http://127.0.0.1:8000", "/v1/models", None, headers={}, timeout=10)

The socket's timeout bounds each wait for bytes and a watchdog bounds the whole exchange: a
server that trickles its headers or body a byte at a time never trips the socket's timeout, so
at the deadline the watchdog shuts the socket and the read in progress fails at once. What went
wrong is an `HTTPFailed`: `late` (the deadline passed) or not (refused, reset, not HTTP), with
the cause; each caller says it in its own words (gspo.sampling.vllm_server, gspo.rewards.judge).
Left out: redirects, keep-alive, retries (a caller retries where a retry is safe).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Callable


class HTTPFailed(Exception):
    """An exchange that did not complete: `late` when its deadline passed, else `cause` says why."""

    def __init__(self, cause: BaseException, late: bool):
        super().__init__(str(cause))
        self.cause, self.late = cause, late


def exchange(url: str, path: str, body: dict | None, *, headers: dict[str, str], timeout: float,
             on_connect: Callable | None = None) -> tuple[int, bytes]:
    """(status, raw body) of one request to `url` + `path`: POST with `body` as JSON, else GET,
    within `timeout` seconds; HTTPFailed otherwise. on_connect(sock): called once connected (a
    caller that may cut the request keeps its socket; what it raises goes through)."""
    parts = urllib.parse.urlsplit(url)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    headers = {"Content-Type": "application/json", **headers}
    data = json.dumps(body).encode() if body is not None else None
    conn = conn_type(parts.hostname, parts.port, timeout=timeout)
    late, watchdog = threading.Event(), None
    try:
        conn.connect()  # within the socket's timeout
        if on_connect is not None:
            on_connect(conn.sock)
        # the socket itself: http.client drops conn.sock once a response that closes the connection began
        watchdog = threading.Timer(timeout, _cut, (conn.sock, late))
        watchdog.daemon = True
        watchdog.start()
        conn.request("POST" if body is not None else "GET", path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    except (TimeoutError, ConnectionError, OSError, http.client.HTTPException) as e:
        raise HTTPFailed(e, late=late.is_set() or isinstance(e, TimeoutError)) from None
    finally:
        if watchdog is not None:
            watchdog.cancel()
        conn.close()


def _cut(sock, late: threading.Event) -> None:
    """The deadline of a request passed: mark it and shut its socket (the blocked read returns)."""
    late.set()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class BadAddress(ValueError):
    """`server_base`'s refusal: `port` when the port is not a number, else not a server's address."""

    def __init__(self, url: str, port: bool):
        super().__init__(f"{url!r} {'has an invalid port' if port else 'is not a server address'}")
        self.port = port


def server_base(url: str, paths: tuple[str, ...], *, fragment: bool = False) -> str:
    """http(s)://HOST:PORT of a server's address as a user typed it: its path one of `paths` once a
    final '/' is dropped, no query, and a fragment only where `fragment`; BadAddress otherwise.

    >>> server_base("http://10.0.0.7:8000/v1/", ("", "/v1"))
    'http://10.0.0.7:8000'
    """
    parts = urllib.parse.urlsplit(url)
    path = parts.path[:-1] if parts.path.endswith("/") else parts.path
    if parts.scheme not in ("http", "https") or not parts.hostname or path not in paths or parts.query \
            or (parts.fragment and not fragment):
        raise BadAddress(url, port=False)
    try:
        _ = parts.port
    except ValueError:
        raise BadAddress(url, port=True) from None
    return f"{parts.scheme}://{parts.netloc}"
