"""Fetch the bytes of one media item from an http(s) URL, a `data:` URI or an allowed local file.

Synchronous and thread-safe: plain functions plus a frozen, picklable `FetchPolicy`, so the worker can
run them in a pool of processes. Every failure is a `MediaError` with a short, human-readable message.

NOTE: URL hosts are resolved once per hop and every resolved address is checked; the connection then
goes to the checked address (never re-resolved), so DNS rebinding cannot reach a private address.
Keep-alive connections are reused per (scheme, host, port, address) within one process, only for an
address the current hop has just validated, and only after a response that was read to its end from a
server that did not say `Connection: close`.
"""

from __future__ import annotations

import binascii
import functools
import http.client
import ipaddress
import re
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import quote, unquote_to_bytes, urljoin, urlsplit

from preprocess.errors import FetchError, ForbiddenSource, MediaTooLarge
from preprocess.http_conn import DeadlineSocket, IdleConnections, remaining
from preprocess.local_media import check_local, local_path, read_local

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]
"""(host, port) -> IP address strings; `system_resolver` by default, a fake one in tests."""

_SCHEME_RE = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_REDIRECTS = (301, 302, 303, 307, 308)
_READ_SIZE = 1 << 16
_URL_SAFE = "!#$%&'()*+,/:;=?@[]~"  # reserved characters and '%': quote only non-ASCII and unsafe ones
_MAX_URL_IN_MESSAGE = 200
# What a kept-alive connection the server has just closed looks like; a GET is safe to repeat.
_STALE_ERRORS = (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)  # incl. http.client.RemoteDisconnected


@dataclass(frozen=True)
class FetchPolicy:
    """Where media may come from and how much of it (built by the worker from `FetchConfig`)."""

    max_bytes: int = 32 * 1024 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 5
    allow_private: bool = False
    allowed_local_dir: str | None = None

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.timeout_s <= 0 or self.max_redirects < 0:
            raise ValueError("need max_bytes > 0, timeout_s > 0 and max_redirects >= 0")


class Target(NamedTuple):
    """One validated hop: where to connect (`addresses`) and what to ask for."""

    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[str, ...]


def fetch_media(source: str, policy: FetchPolicy, *, resolver: Resolver | None = None) -> bytes:
    """Return the bytes of one media source.

    Args:
        source: an `http(s)://` URL, a `data:` URI, a `file://` URL or an absolute local path.
        policy: limits and what is allowed.
        resolver: host resolution for URLs (default `system_resolver`); injectable for tests.
    Raises:
        ForbiddenSource: scheme, address or local path not allowed.
        MediaTooLarge: more than `policy.max_bytes` bytes.
        FetchError: anything else (unreachable, HTTP error status, timeout, malformed source).
    """
    kind = _source_kind(source)
    if kind == "data":
        return decode_data_uri(source, policy.max_bytes)
    if kind == "file":
        return read_local(local_path(source, policy), policy.max_bytes, source)
    return _fetch_http(source, policy, resolver or system_resolver)


def check_source(source: str, policy: FetchPolicy) -> None:
    """Cheap validation at request-parse time; raises what `fetch_media` would for the same reason.

    No network and no DNS: the scheme must be allowed, a `data:` URI must decode within the limit, a
    local path must lie inside the allowed directory, and a URL whose host is an IP literal (or
    `localhost`) must be public unless `policy.allow_private`.
    """
    kind = _source_kind(source)
    if kind == "data":
        decode_data_uri(source, policy.max_bytes)
    elif kind == "file":
        check_local(local_path(source, policy), policy.max_bytes, source)
    else:
        _, host, port, _ = _split_url(source)
        if policy.allow_private:
            return
        bare = host.rstrip(".").lower()
        if bare == "localhost" or bare.endswith(".localhost"):
            raise ForbiddenSource(f"host {host!r} is not a public address")
        try:  # AI_NUMERICHOST parses IP literals (also legacy forms like 127.1) and never does DNS
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except (socket.gaierror, UnicodeError):
            return  # a name; checked after resolution at fetch time
        _check_addresses(host, [str(info[4][0]) for info in infos])


def decode_data_uri(uri: str, max_bytes: int) -> bytes:
    """Decode `data:[<mime>][;base64],<payload>`: strict base64 (padding optional) or percent-encoding.

    Raises FetchError when malformed, MediaTooLarge (before decoding) when above `max_bytes`.
    """
    header, sep, payload = uri.partition(",")
    if not sep or header[:5].lower() != "data:":
        raise FetchError("malformed data: URI (expected data:[<mime>][;base64],<payload>)")
    if not header.lower().endswith(";base64"):
        raw = unquote_to_bytes(payload)
        if len(raw) > max_bytes:
            raise _too_large(max_bytes)
        return raw
    data = payload.encode("ascii", errors="replace")
    if b"%" in data:
        data = unquote_to_bytes(data)
    num_chars = len(data.rstrip(b"="))
    if num_chars * 3 // 4 > max_bytes:
        raise _too_large(max_bytes)
    if num_chars % 4 == 1 or len(data) - num_chars > 2:
        raise FetchError("invalid base64 in data: URI")
    try:
        return binascii.a2b_base64(data[:num_chars] + b"=" * (-num_chars % 4), strict_mode=True)
    except binascii.Error:
        raise FetchError("invalid base64 in data: URI") from None


def system_resolver(host: str, port: int) -> list[str]:
    """All addresses `host` resolves to (IPv4 and IPv6), in resolver order, without duplicates."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchError(f"cannot resolve host {_short(host)!r}") from exc
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_public_address(ip: IPAddress) -> bool:
    """True when `ip` is globally routable unicast; IPv4 embedded in IPv6 is judged as that IPv4.

    Refuses loopback, private (10/8, 172.16/12, 192.168/16, fc00::/7), CGNAT 100.64/10, link-local
    (169.254/16 incl. cloud metadata, fe80::/10), site-local, multicast, reserved, unspecified, and
    IPv4-mapped / 6to4 / NAT64 addresses wrapping any of those.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(embedded)
        if ip.is_site_local:
            return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local
                                 or ip.is_unspecified or ip.is_private)


def resolve_target(url: str, policy: FetchPolicy, resolver: Resolver | None = None) -> Target:
    """Validate one hop (scheme, host, every resolved address) and return where to connect.

    Raises ForbiddenSource for a disallowed scheme or address, FetchError for a malformed URL.
    """
    scheme, host, port, path = _split_url(url)
    try:
        addresses = [str(ipaddress.ip_address(host))]  # literal: no resolver involved
    except ValueError:
        addresses = list((resolver or system_resolver)(host, port))
    if not addresses:
        raise FetchError(f"cannot resolve host {_short(host)!r}")
    if not policy.allow_private:
        _check_addresses(host, addresses)
    return Target(scheme, host, port, path, tuple(addresses))


# ------------------------------------------------------------------------------------------ http(s)


def close_idle_connections() -> None:
    """Close every kept-alive connection this process holds (they are otherwise dropped after 30 s idle)."""
    _IDLE.clear()


def _fetch_http(url: str, policy: FetchPolicy, resolver: Resolver) -> bytes:
    deadline = time.monotonic() + policy.timeout_s
    seen: set[str] = set()
    for _ in range(policy.max_redirects + 1):
        seen.add(url)
        target = resolve_target(url, policy, resolver)
        try:
            location = _request(target, url, deadline, policy)
        except TimeoutError:
            raise FetchError(f"timed out after {policy.timeout_s:g} s fetching {_short(url)}") from None
        except (OSError, http.client.HTTPException, UnicodeError) as exc:
            raise FetchError(f"cannot fetch {_short(url)}: {_describe(exc)}") from exc
        if isinstance(location, bytes):
            return location
        url = urljoin(url, location).partition("#")[0]
        if url in seen:
            raise FetchError(f"redirect loop at {_short(url)}")
    raise FetchError(f"too many redirects (more than {policy.max_redirects})")


def _request(target: Target, url: str, deadline: float, policy: FetchPolicy) -> bytes | str:
    """One GET on a validated target: the body, or the `Location` of a redirect."""
    idle = _IDLE.take({(target.scheme, target.host, target.port, address) for address in target.addresses})
    if idle is not None:
        try:
            return _exchange(*idle, target, url, deadline, policy)
        except _STALE_ERRORS:  # closed by the server while idle: once more on a fresh connection
            pass
    return _exchange(*_connect(target, deadline), target, url, deadline, policy)


def _exchange(raw: socket.socket, address: str, target: Target, url: str, deadline: float,
              policy: FetchPolicy) -> bytes | str:
    """One GET on the connected `raw`; keeps `raw` for reuse when the whole response was read."""
    conn = http.client.HTTPConnection(target.host, target.port)
    conn.sock = DeadlineSocket(raw, deadline)
    can_reuse = False
    try:
        conn.request("GET", target.path, headers={"User-Agent": "mmenc-fetch", "Accept-Encoding": "identity"})
        resp = conn.getresponse()
        if resp.status in _REDIRECTS:
            location = resp.getheader("Location")
            if not location:
                raise FetchError(f"HTTP {resp.status} redirect without Location from {_short(url)}")
            return location
        if resp.status >= 300:
            raise FetchError(f"HTTP {resp.status} {resp.reason} from {_short(url)}")
        declared = resp.length
        if declared is not None and declared > policy.max_bytes:
            raise _too_large(policy.max_bytes)
        body = bytearray()
        while chunk := resp.read(min(_READ_SIZE, policy.max_bytes + 1 - len(body))):
            body += chunk
            if len(body) > policy.max_bytes:
                raise _too_large(policy.max_bytes)
        if declared is not None and len(body) < declared:
            raise FetchError(f"truncated body: {len(body)} of {declared} bytes from {_short(url)}")
        can_reuse = resp.isclosed() and not resp.will_close  # read to its end; no `Connection: close`
        return bytes(body)
    finally:
        conn.close()
        if can_reuse:
            _IDLE.put((target.scheme, target.host, target.port, address), raw)
        else:
            raw.close()


def _connect(target: Target, deadline: float) -> tuple[socket.socket, str]:
    """Connect to the first reachable validated address (TLS with SNI + cert check for https).

    Returns the socket and the address it is connected to.
    """
    error: OSError = OSError("no address")
    for address in target.addresses:
        try:
            sock = socket.create_connection((address, target.port), timeout=remaining(deadline))
        except OSError as exc:
            error = exc
            continue
        if target.scheme == "http":
            return sock, address
        try:  # NOTE: the handshake's recvs each get the time left, so a trickling handshake can overrun
            sock.settimeout(remaining(deadline))
            return _tls_context().wrap_socket(sock, server_hostname=target.host), address
        except BaseException:
            sock.close()
            raise
    raise error


_IDLE = IdleConnections()


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # shared per process; thread-safe for wrap_socket




# ------------------------------------------------------------------------------------------ helpers


def _source_kind(source: str) -> str:
    """'http', 'data' or 'file'; raises for anything else."""
    if not source or not source.strip():
        raise FetchError("empty media source")
    if source.startswith("/"):
        return "file"
    match = _SCHEME_RE.match(source)
    if match is None:
        raise FetchError(f"unsupported media source {_short(source)!r}: use an http(s) URL, a data: URI "
                         "or an absolute path")
    scheme = match.group(1).lower()
    if scheme in ("http", "https", "data", "file"):
        return "http" if scheme == "https" else scheme
    raise ForbiddenSource(f"scheme {scheme!r} is not allowed (allowed: http, https, data, file)")


def _split_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, request path) of an http(s) URL."""
    if any(c <= " " or c == "\x7f" for c in url):
        raise FetchError(f"invalid URL {_short(url)!r}: whitespace or control characters")
    try:  # NOTE: urlsplit itself raises ValueError on a malformed IPv6 host ("http://[::1")
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise FetchError(f"invalid URL {_short(url)!r}: bad host or port") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ForbiddenSource(f"scheme {scheme!r} is not allowed for URLs (allowed: http, https)")
    if not host:
        raise FetchError(f"invalid URL {_short(url)!r}: no host")
    if parts.username is not None or parts.password is not None:
        raise FetchError(f"invalid URL {_short(url)!r}: credentials in URLs are not supported")
    path = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe=_URL_SAFE)
    return scheme, host, port or (443 if scheme == "https" else 80), path


def _check_addresses(host: str, addresses: Sequence[str]) -> None:
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address.partition("%")[0])
        except ValueError:
            raise ForbiddenSource(f"host {_short(host)!r} resolved to an unparsable address") from None
        if not is_public_address(ip):
            raise ForbiddenSource(f"host {_short(host)!r} resolves to non-public address {ip}")


def _too_large(max_bytes: int) -> MediaTooLarge:
    return MediaTooLarge(f"media is larger than the limit of {max_bytes} bytes")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate check failed: {exc.verify_message}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _short(text: str) -> str:
    return text if len(text) <= _MAX_URL_IN_MESSAGE else text[: _MAX_URL_IN_MESSAGE - 3] + "..."
