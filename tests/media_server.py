"""A threaded HTTP server on 127.0.0.1 for tests: serves given bytes, plus paths that misbehave.

    with MediaServer({"/a.jpg": jpeg_bytes}) as srv:
        fetch(srv.url("/a.jpg"))
        srv.add("/b.png", png_bytes)                  # also after start
        fetch(srv.redirect_url(srv.url("/b.png")))    # 302 -> /b.png
        assert srv.requests[-1].path == "/b.png"

Special paths (query parameters are optional):

    /redirect?to=URL&code=302   redirect to URL (relative or absolute)
    /chain/N                    N redirects in a row, then 200 b"end of chain"
    /loop                       redirects to itself forever
    /status/CODE                answers CODE with a short text body
    /stall                      reads the request, never answers (until the server stops)
    /trickle?n=N&interval=S     200 with Content-Length N, then one byte every S seconds
    /slow-headers?interval=S    status line and headers sent one byte every S seconds
    /big?size=N&content_length=M&chunked=1
                                N zero bytes (default: endless, until the client hangs up) with no
                                Content-Length, or the declared (possibly wrong) M, or chunked encoding

Pass `tls=ssl_context` (server side, with a cert loaded) to serve https; `url()` then says https.
Pass `keep_alive=True` to keep connections open after file and /status answers (HTTP/1.1 keep-alive);
`num_connections` counts accepted connections, `drop_connections()` closes the open ones as an idle
timeout would. `stop()` (or leaving the `with`) returns in well under a second, even with stalled clients.
"""

from __future__ import annotations

import http.server
import socket
import ssl
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import parse_qs, quote, urlsplit

_ZEROS = bytes(1 << 16)


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server received (recorded before it is answered)."""

    method: str
    path: str  # including the query string
    headers: dict[str, str]


class MediaServer:
    """Serve `files` (path -> bytes) and the special paths on 127.0.0.1 at an ephemeral port."""

    def __init__(self, files: Mapping[str, bytes] | None = None, *, host: str = "127.0.0.1",
                 tls: ssl.SSLContext | None = None, keep_alive: bool = False) -> None:
        self._host, self._tls, self.keep_alive = host, tls, keep_alive
        self._files: dict[str, tuple[bytes, str]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.requests: list[RecordedRequest] = []
        self.num_connections = 0  # accepted so far
        self._open: set[socket.socket] = set()
        for path, body in (files or {}).items():
            self.add(path, body)

    def add(self, path: str, body: bytes, content_type: str = "application/octet-stream") -> None:
        """Serve `body` at `path` (e.g. "/a.jpg"); may be called before or after `start()`."""
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/': {path!r}")
        with self._lock:
            self._files[path] = (bytes(body), content_type)

    def start(self) -> MediaServer:
        """Bind an ephemeral port and serve on a daemon thread."""
        if self._httpd is not None:
            raise RuntimeError("MediaServer already started")
        self._stopping.clear()
        self._httpd = _HTTPServer((self._host, 0), _Handler)
        self._httpd.media = self
        if self._tls is not None:  # the handshake runs on the handler thread, not the accept loop
            self._httpd.socket = self._tls.wrap_socket(self._httpd.socket, server_side=True,
                                                       do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="media-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; wakes stalled and trickling handlers so nothing outlives the test."""
        if self._httpd is None:
            return
        self._stopping.set()
        self.drop_connections()
        self._httpd.shutdown()
        self._httpd.server_close()
        assert self._thread is not None
        self._thread.join(timeout=2)
        self._httpd = None

    def drop_connections(self) -> None:
        """Shut down every open client connection (as a server closing idle keep-alive connections)."""
        with self._lock:
            connections = list(self._open)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> MediaServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("MediaServer is not started")
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self._host}:{self.port}"

    def url(self, path: str = "/") -> str:
        """Absolute URL of `path` on this server."""
        return self.base_url + path

    def redirect_url(self, to: str, code: int = 302) -> str:
        """URL that answers `code` with `Location: to`."""
        return self.url(f"/redirect?to={quote(to, safe='')}&code={code}")

    def _lookup(self, path: str) -> tuple[bytes, str] | None:
        with self._lock:
            return self._files.get(path)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    media: MediaServer

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError | ssl.SSLError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    timeout = 30

    def setup(self) -> None:
        with self.server.media._lock:
            self.server.media.num_connections += 1
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()
        with self.server.media._lock:
            self.server.media._open.add(self.connection)

    def finish(self) -> None:
        with self.server.media._lock:
            self.server.media._open.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        media = self.server.media
        media.requests.append(RecordedRequest(self.command, self.path, dict(self.headers.items())))
        if not media.keep_alive:
            self.close_connection = True
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        route = parts.path
        try:
            if (entry := media._lookup(route)) is not None:
                self._send(200, entry[0], entry[1])
            elif route == "/redirect":
                self._redirect(query.get("to", "/"), int(query.get("code", 302)))
            elif route.startswith("/chain/"):
                n = int(route.removeprefix("/chain/"))
                self._redirect(f"/chain/{n - 1}") if n > 0 else self._send(200, b"end of chain")
            elif route == "/loop":
                self._redirect("/loop")
            elif route.startswith("/status/"):
                code = int(route.removeprefix("/status/"))
                self._send(code, f"status {code}\n".encode())
            elif route == "/stall":
                media._stopping.wait()
            elif route == "/trickle":
                self._trickle(int(query.get("n", 1000)), float(query.get("interval", 0.05)))
            elif route == "/slow-headers":
                self._slow_headers(float(query.get("interval", 0.05)))
            elif route == "/big":
                self._big(query)
            else:
                self._send(404, b"not found\n")
        except (ConnectionError, TimeoutError):
            pass

    def _send(self, code: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if not self.server.media.keep_alive:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str, code: int = 302) -> None:
        self.send_response(code)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()

    def _trickle(self, n: int, interval: float) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()
        for _ in range(n):
            if self.server.media._stopping.wait(interval):
                return
            self.wfile.write(b"x")
            self.wfile.flush()

    def _slow_headers(self, interval: float) -> None:
        head = b"HTTP/1.1 200 OK\r\nX-Padding: " + b"p" * 200 + b"\r\nContent-Length: 2\r\n\r\nok"
        for i in range(len(head)):
            if self.server.media._stopping.wait(interval):
                return
            self.wfile.write(head[i : i + 1])
            self.wfile.flush()

    def _big(self, query: dict[str, str]) -> None:
        remaining = int(query["size"]) if "size" in query else None
        is_chunked = query.get("chunked") == "1"
        self.send_response(200)
        if "content_length" in query:
            self.send_header("Content-Length", query["content_length"])
        if is_chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        while (remaining is None or remaining > 0) and not self.server.media._stopping.is_set():
            chunk = _ZEROS if remaining is None else _ZEROS[: min(remaining, len(_ZEROS))]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if is_chunked else chunk)
            if remaining is not None:
                remaining -= len(chunk)
        if is_chunked:
            self.wfile.write(b"0\r\n\r\n")
