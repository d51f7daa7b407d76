"""Bounded reads of what a cluster serves: every answer has a byte cap and a deadline.

``ray-mesh status`` reads the dashboard's JSON, every node's Prometheus text and, when the
viewer names the storage, a layout file. Any of them may be wrong, huge or slow (a wedged
head, a proxy, or a cluster that is not what it claims). A socket timeout alone bounds one
``recv``, not an answer: a server that sends a byte every second holds ``read()`` forever,
and one that sends 50 GB fills the memory. Here each answer must arrive whole within its
time and under its cap, and the error names the source and which bound it broke.

The deadline is enforced by shutting the request's sockets down when it passes (a watchdog
timer), so no thread stays blocked in a read after the call returned. Credentials go only
to the origin they were meant for across redirects, and only http(s) is spoken.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from ray_mesh.core.safe import safe_text
from ray_mesh.errors import SourceError, SourceTimeout

T = TypeVar("T")
CHUNK = 1 << 16
# A timed-out answer's second ask may take this many times its bound (within the deadline).
PATIENCE = 4.0
SECRET_HEADERS = ("authorization", "x-ray-authorization", "cookie", "proxy-authorization")


class Deadline:
    """A budget for a whole command: every read takes at most what is left of it."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.end = time.monotonic() + total_s
        # (what, seconds from the first ask to the answer) of answers that needed a second ask
        self.slow: list[tuple[str, float]] = []

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def bound(self, timeout_s: float) -> float:
        """The time one read may take: its own bound, or what is left, whichever is less."""
        return min(timeout_s, self.left())


def patiently(read: Callable[[float], T], timeout_s: float, deadline: Deadline | None,
              what: str) -> T:
    """``read(bound)`` within ``timeout_s``; one that timed out is asked once more with up
    to ``PATIENCE`` times as long, as far as the deadline leaves, and noted in
    ``deadline.slow``. Without a deadline (one read for a caller of its own), only once.

    A head far past its cores answers slowly but answers: the Train state's run list took
    over 5 s at load 17 on 2 cores, and a status without its runs is of no use. A stalled
    source still ends at the second bound, and the command at its deadline.
    """
    if deadline is None:
        return read(timeout_s)
    first = deadline.bound(timeout_s)
    t0 = time.monotonic()
    try:
        return read(first)
    except SourceTimeout:
        second = min(deadline.left(), PATIENCE * timeout_s)
        if second <= first:
            raise
        out = read(second)
        deadline.slow.append((what, time.monotonic() - t0))
        return out


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(
        scheme)


class _SameOriginCredentials(urllib.request.HTTPRedirectHandler):
    """Follow redirects over http(s) only, sending credentials only to the first origin.

    urllib copies every header to the redirect target, so a dashboard (or anything in
    between) answering 302 to another host would receive the bearer token. A redirect to
    another scheme, host or port drops the credential headers; the request then fails there
    with 401/403 unless that origin needs no token. A redirect to ftp:// (which urllib
    would follow) is refused.
    """

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, D102
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, f"redirect to {safe_text(newurl, 200)} "
                                         "refused: only http(s) is followed", headers, fp)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for name in list(new.headers):
                if name.lower() in SECRET_HEADERS:
                    del new.headers[name]
        return new


class _Guard:
    """The sockets of one request, shut down when its deadline passes."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self.fired = False

    def connect(self, address: Any, timeout: Any = None, source_address: Any = None
                ) -> socket.socket:
        sock = socket.create_connection(address, timeout, source_address)
        with self._lock:
            if self.fired:
                sock.close()
                raise TimeoutError("the deadline passed while connecting")
            self._socks.append(sock)
        return sock

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            socks = list(self._socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _guarded(base: type[http.client.HTTPConnection], guard: _Guard) -> Any:
    class Conn(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._create_connection = guard.connect

    return Conn


def _opener(guard: _Guard) -> urllib.request.OpenerDirector:
    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):  # noqa: ANN001, ANN202
            return self.do_open(_guarded(http.client.HTTPConnection, guard), req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):  # noqa: ANN001, ANN202
            return self.do_open(_guarded(http.client.HTTPSConnection, guard), req,
                                context=self._context)

    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.UnknownHandler(), Http(),
                    Https(), urllib.request.HTTPDefaultErrorHandler(),
                    _SameOriginCredentials(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def _read_capped(resp: Any, max_bytes: int, guard: _Guard, what: str, limit_s: float) -> bytes:
    parts, size = [], 0
    while True:
        try:
            chunk = resp.read1(CHUNK)
        except (OSError, http.client.HTTPException):
            if guard.fired:
                break
            raise
        if not chunk:
            break
        size += len(chunk)
        if size > max_bytes:
            raise SourceError(f"{what} is larger than {max_bytes / 2**20:g} MiB: not read "
                              f"further")
        parts.append(chunk)
    if guard.fired:
        raise SourceTimeout(f"{what} did not arrive whole within {limit_s:g} s (slow or stalled "
                          f"after {size} bytes)")
    return b"".join(parts)


def http_get(url: str, *, timeout_s: float, max_bytes: int,
             headers: dict[str, str] | None = None, what: str | None = None,
             deadline: Deadline | None = None) -> bytes:
    """The body of ``url``, whole within ``timeout_s`` (and the ``deadline``), at most
    ``max_bytes``; else :class:`SourceError` naming ``what`` (default: the URL).

    HTTP errors (``urllib.error.HTTPError``) and connection errors (``OSError``) pass
    through for the caller's advice; an error's own body is read capped too.
    """
    what = what or f"the answer of {safe_text(url, 300)}"
    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
        raise SourceError(f"{what}: only http(s) URLs are read, not {safe_text(url, 300)}")
    limit_s = deadline.bound(timeout_s) if deadline else timeout_s
    if limit_s <= 0:
        raise SourceError(f"{what} was not asked: the command's deadline "
                          f"({deadline.total_s:g} s) had passed" if deadline else what)
    guard = _Guard()
    timer = threading.Timer(limit_s, guard.fire)
    timer.daemon = True
    timer.start()
    try:
        req = urllib.request.Request(url, headers=headers or {})
        try:
            with _opener(guard).open(req, timeout=max(limit_s, 0.1)) as resp:  # noqa: S310
                return _read_capped(resp, max_bytes, guard, what, limit_s)
        except urllib.error.HTTPError as exc:
            body = b""
            with contextlib.suppress(Exception):
                body = _read_capped(exc, 4096, guard, what, limit_s)
            exc.body_text = safe_text(body.decode("utf-8", "replace"), 300)  # type: ignore[attr-defined]
            raise
        except (OSError, http.client.HTTPException) as exc:
            # the watchdog closed the socket, or the socket's own read timeout came first (a
            # connect timeout is a URLError, left to the caller's advice)
            if guard.fired or isinstance(exc, TimeoutError):
                raise SourceTimeout(f"{what} did not arrive within {limit_s:g} s (the server "
                                  f"accepted but was too slow)") from exc
            raise
    finally:
        timer.cancel()
        guard.fire()  # close what is left (a keep-alive socket) at once


def read_storage_file(storage: str, relpath: str, *, timeout_s: float, max_bytes: int,
                      what: str, endpoint: str | None = None,
                      filesystem: Any = None) -> bytes | None:
    """``<storage>/<relpath>`` through pyarrow (local path or URI), bounded; None: absent.

    Only for storage the viewer named: a URI opens with this machine's cloud credentials.
    ``endpoint``: the S3-compatible server of an ``s3://`` storage (``--storage-endpoint``);
    ``filesystem``: a pyarrow filesystem ``storage`` is a path in (Ray's ``Result``).
    pyarrow's reads cannot be interrupted, so the read runs in a daemon thread and the
    caller stops waiting at ``timeout_s``.
    """
    out: dict[str, Any] = {}

    def read() -> None:
        try:
            import pyarrow.fs

            from ray_mesh.core.object_store import filesystem as storage_fs

            if filesystem is not None:
                fs, base = filesystem, storage
            else:
                fs, base = storage_fs(storage, endpoint, timeout_s=timeout_s, retries=1) \
                    if storage.startswith("s3://") else storage_fs(storage, endpoint)
            path = f"{base.rstrip('/')}/{relpath}"
            if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
                out["data"] = None
                return
            with fs.open_input_stream(path) as f:
                out["data"] = f.read(max_bytes + 1)
        except Exception as exc:  # noqa: BLE001 - reported as the source's problem
            out["error"] = exc

    worker = threading.Thread(target=read, name="ray_mesh-storage-read", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise SourceTimeout(f"{what}: no answer from the storage within {timeout_s:g} s")
    if "error" in out:
        exc = out["error"]
        raise SourceError(f"{what}: {type(exc).__name__}: {safe_text(exc, 300)}")
    data = out.get("data")
    if data is not None and len(data) > max_bytes:
        raise SourceError(f"{what} is larger than {max_bytes / 2**20:g} MiB: not read")
    return data
