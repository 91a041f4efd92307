"""preprocess.fetch against a real HTTP server on 127.0.0.1 (tests/media_server.py).

NOTE: nothing here may connect anywhere but 127.0.0.1; the autouse `loopback_only` fixture fails any
test that tries, so "refused" below also means "refused without sending traffic".
"""

from __future__ import annotations

import base64
import ipaddress
import os
import pickle
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preprocess import fetch
from preprocess.errors import FetchError, ForbiddenSource, MediaError, MediaTooLarge
from preprocess.fetch import (
    FetchPolicy,
    check_source,
    decode_data_uri,
    fetch_media,
    is_public_address,
    resolve_target,
)

try:
    from tests.media_server import MediaServer
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from media_server import MediaServer

JPEG = b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4
LOOPBACK = FetchPolicy(timeout_s=2.0, allow_private=True)
PUBLIC_ONLY = FetchPolicy(timeout_s=2.0)


@pytest.fixture(scope="module")
def srv() -> Iterator[MediaServer]:
    with MediaServer({"/a.jpg": JPEG, "/kb": bytes(1000)}) as server:
        yield server


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every connection attempt, and a failure for any that is not to 127.0.0.1."""
    real, attempts = socket.create_connection, []

    def guarded(address: tuple[str, int], *args: object, **kwargs: object) -> socket.socket:
        attempts.append(address[0])
        if address[0] != "127.0.0.1":
            raise AssertionError(f"test tried to connect to {address[0]}")
        return real(address, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "create_connection", guarded)
    return attempts


def fake_resolver(table: dict[str, list[str]]) -> fetch.Resolver:
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise AssertionError(f"unexpected resolve of {host!r}")
        return table[host]
    return resolve


# ------------------------------------------------------------------------------------- http + policy


def test_fetch_ok_from_loopback_when_private_allowed(srv: MediaServer) -> None:
    assert fetch_media(srv.url("/a.jpg"), LOOPBACK) == JPEG
    headers = srv.requests[-1].headers
    assert headers["Host"] == f"127.0.0.1:{srv.port}" and headers["Accept-Encoding"] == "identity"


def test_same_url_refused_when_private_disallowed(srv: MediaServer, loopback_only: list[str]) -> None:
    num_requests = len(srv.requests)
    with pytest.raises(ForbiddenSource, match="non-public address 127.0.0.1"):
        fetch_media(srv.url("/a.jpg"), PUBLIC_ONLY)
    assert loopback_only == [] and len(srv.requests) == num_requests


@pytest.mark.parametrize("host", [
    "10.0.0.1", "169.254.169.254", "[::1]", "0.0.0.0", "100.64.0.1", "localhost", "127.1", "2130706433",
    "0x7f000001", "[::ffff:127.0.0.1]", "[::ffff:169.254.169.254]", "[fe80::1]", "[fd00::1]", "224.0.0.1",
    "192.168.1.1", "172.16.0.1", "255.255.255.255",
])
def test_private_hosts_refused_without_connecting(host: str, loopback_only: list[str]) -> None:
    with pytest.raises(ForbiddenSource):
        fetch_media(f"http://{host}:8080/latest/meta-data/", PUBLIC_ONLY)
    with pytest.raises(ForbiddenSource):
        check_source(f"https://{host}/x.jpg", PUBLIC_ONLY)
    assert loopback_only == []


@pytest.mark.parametrize("address", [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8", "2002:808:808::1",
    "64:ff9b::808:808",
])
def test_public_addresses(address: str) -> None:
    assert is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.1.2.3", "172.31.255.255", "192.168.0.1", "169.254.169.254", "100.64.0.1",
    "100.127.255.254", "0.0.0.0", "224.0.0.251", "240.0.0.1", "255.255.255.255", "192.0.0.170",
    "198.18.0.1", "::", "::1", "fe80::1", "fc00::1", "fec0::1", "ff02::1", "::ffff:10.0.0.1",
    "::ffff:127.0.0.1", "::127.0.0.1", "2002:7f00:1::", "2002:a9fe:a9fe::", "64:ff9b::a00:1",
    "2001:db8::1", "2001::1",
])
def test_non_public_addresses(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


def test_hostname_refused_if_any_address_private(loopback_only: list[str]) -> None:
    resolver = fake_resolver({"mixed.test": ["93.184.216.34", "10.0.0.1"]})
    with pytest.raises(ForbiddenSource, match="10.0.0.1"):
        fetch_media("http://mixed.test/a.jpg", PUBLIC_ONLY, resolver=resolver)
    assert loopback_only == []


def test_resolve_target_of_public_host() -> None:
    resolver = fake_resolver({"cdn.test": ["93.184.216.34", "2606:4700:4700::1111"]})
    target = resolve_target("https://cdn.test/img/a.jpg?w=1", PUBLIC_ONLY, resolver)
    assert target == ("https", "cdn.test", 443, "/img/a.jpg?w=1", ("93.184.216.34", "2606:4700:4700::1111"))


def test_connects_to_the_validated_address_with_original_host(srv: MediaServer) -> None:
    calls: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"]

    assert fetch_media(f"http://media.test:{srv.port}/a.jpg", LOOPBACK, resolver=resolver) == JPEG
    assert calls == ["media.test"]  # resolved once, never again (no DNS rebinding window)
    assert srv.requests[-1].headers["Host"] == f"media.test:{srv.port}"


def test_non_ascii_path_and_host(srv: MediaServer) -> None:
    srv.add("/%C3%A4.jpg", JPEG)
    resolver = fake_resolver({"bücher.test": ["127.0.0.1"], "ä..test": ["127.0.0.1"]})
    assert fetch_media(f"http://bücher.test:{srv.port}/ä.jpg", LOOPBACK, resolver=resolver) == JPEG
    assert srv.requests[-1].headers["Host"] == f"xn--bcher-kva.test:{srv.port}"
    with pytest.raises(FetchError, match="cannot fetch"):  # IDNA cannot encode an empty label
        fetch_media(f"http://ä..test:{srv.port}/a.jpg", LOOPBACK, resolver=resolver)


def test_redirects_followed(srv: MediaServer) -> None:
    assert fetch_media(srv.redirect_url("/a.jpg"), LOOPBACK) == JPEG
    assert fetch_media(srv.redirect_url(srv.url("/a.jpg"), code=307), LOOPBACK) == JPEG
    policy = FetchPolicy(max_redirects=5, allow_private=True)
    assert fetch_media(srv.url("/chain/5"), policy) == b"end of chain"


def test_too_many_redirects(srv: MediaServer) -> None:
    with pytest.raises(FetchError, match=r"too many redirects \(more than 2\)"):
        fetch_media(srv.url("/chain/3"), FetchPolicy(max_redirects=2, allow_private=True))
    with pytest.raises(FetchError, match="too many redirects"):
        fetch_media(srv.redirect_url("/a.jpg"), FetchPolicy(max_redirects=0, allow_private=True))


def test_redirect_loop(srv: MediaServer) -> None:
    with pytest.raises(FetchError, match="redirect loop"):
        fetch_media(srv.url("/loop"), LOOPBACK)


@pytest.mark.parametrize("location", [
    "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/", "http://[::1]:8080/",
    "http://internal.test/", "file:///etc/passwd", "data:;base64,AAAA", "ftp://example.com/a.jpg",
])
def test_redirect_into_forbidden_target_refused(srv: MediaServer, monkeypatch: pytest.MonkeyPatch,
                                                loopback_only: list[str], location: str) -> None:
    # Pretend 127.0.0.1 is public so the first hop (our server) passes the address policy.
    real = fetch.is_public_address
    monkeypatch.setattr(fetch, "is_public_address", lambda ip: str(ip) == "127.0.0.1" or real(ip))
    resolver = fake_resolver({"internal.test": ["10.1.2.3"]})
    with pytest.raises(ForbiddenSource):
        fetch_media(srv.redirect_url(location), PUBLIC_ONLY, resolver=resolver)
    assert loopback_only == ["127.0.0.1"]  # the first hop only


@pytest.mark.parametrize("code", [404, 403, 500])
def test_http_error_status(srv: MediaServer, code: int) -> None:
    with pytest.raises(FetchError, match=f"HTTP {code}"):
        fetch_media(srv.url(f"/status/{code}"), LOOPBACK)
    with pytest.raises(FetchError, match="HTTP 404"):
        fetch_media(srv.url("/missing.jpg"), LOOPBACK)


def test_byte_limit_at_and_over(srv: MediaServer) -> None:
    assert fetch_media(srv.url("/kb"), FetchPolicy(max_bytes=1000, allow_private=True)) == bytes(1000)
    with pytest.raises(MediaTooLarge, match="limit of 999 bytes") as info:
        fetch_media(srv.url("/kb"), FetchPolicy(max_bytes=999, allow_private=True))
    assert info.value.status == 413


@pytest.mark.parametrize("query", [
    "size=5000&content_length=5000",  # refused from the header
    "content_length=5000",            # header, endless body
    "",                               # no Content-Length, endless body
    "chunked=1",                      # chunked, endless
    "size=5000&content_length=10",    # wrong (small) Content-Length: only 10 bytes are read
])
def test_byte_limit_streamed(srv: MediaServer, query: str) -> None:
    policy = FetchPolicy(max_bytes=1000, timeout_s=2.0, allow_private=True)
    if query.endswith("content_length=10"):
        assert fetch_media(srv.url(f"/big?{query}"), policy) == bytes(10)
        return
    with pytest.raises(MediaTooLarge, match="limit of 1000 bytes"):
        fetch_media(srv.url(f"/big?{query}"), policy)


def test_chunked_and_truncated_bodies(srv: MediaServer) -> None:
    assert fetch_media(srv.url("/big?size=200000&chunked=1"), LOOPBACK) == bytes(200000)
    assert fetch_media(srv.url("/big?size=70000"), LOOPBACK) == bytes(70000)
    with pytest.raises(FetchError, match="truncated body: 10 of 100 bytes"):
        fetch_media(srv.url("/big?size=10&content_length=100"), LOOPBACK)


@pytest.mark.parametrize("path", ["/stall", "/trickle?n=1000&interval=0.05", "/slow-headers?interval=0.02"])
def test_overall_timeout(srv: MediaServer, path: str) -> None:
    start = time.monotonic()
    with pytest.raises(FetchError, match=r"timed out after 0.5 s"):
        fetch_media(srv.url(path), FetchPolicy(timeout_s=0.5, allow_private=True))
    assert 0.45 < time.monotonic() - start < 1.5


def test_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(FetchError, match="connection refused"):
        fetch_media(f"http://127.0.0.1:{port}/a.jpg", LOOPBACK)


def test_https_to_plain_http_server_fails_cleanly(srv: MediaServer) -> None:
    with pytest.raises(FetchError, match="cannot fetch https://") as info:
        fetch_media(f"https://127.0.0.1:{srv.port}/a.jpg", LOOPBACK)
    assert "Traceback" not in info.value.message


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MediaServer, ssl.SSLContext]]:
    """An https MediaServer with a self-signed cert for media.test, and a client context trusting it."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", d / "key.pem", "-out", d / "cert.pem", "-days", "1",
                    "-subj", "/CN=media.test", "-addext", "subjectAltName=DNS:media.test"],
                   check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    with MediaServer({"/a.jpg": JPEG}, tls=server_ctx) as server:
        yield server, ssl.create_default_context(cafile=d / "cert.pem")


def test_https_checks_cert_against_original_hostname(tls_server: tuple[MediaServer, ssl.SSLContext],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    server, trusting_ctx = tls_server
    resolver = fake_resolver({"media.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    with pytest.raises(FetchError, match="TLS certificate check failed"):  # self-signed: untrusted
        fetch_media(f"https://media.test:{server.port}/a.jpg", LOOPBACK, resolver=resolver)
    monkeypatch.setattr(fetch, "_tls_context", lambda: trusting_ctx)
    assert fetch_media(f"https://media.test:{server.port}/a.jpg", LOOPBACK, resolver=resolver) == JPEG
    assert server.requests[-1].headers["Host"] == f"media.test:{server.port}"
    with pytest.raises(FetchError, match="Hostname mismatch"):  # checked against other.test, not the IP
        fetch_media(f"https://other.test:{server.port}/a.jpg", LOOPBACK, resolver=resolver)


def test_concurrent_fetches(srv: MediaServer) -> None:
    for i in range(16):
        srv.add(f"/item{i}", bytes([i]) * (1000 + i))
    with ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(lambda i: fetch_media(srv.url(f"/item{i}"), LOOPBACK), range(16)))
    assert bodies == [bytes([i]) * (1000 + i) for i in range(16)]


# ------------------------------------------------------------------------------------- keep-alive


@pytest.fixture
def keep_alive_srv() -> Iterator[MediaServer]:
    with MediaServer({"/a.jpg": JPEG}, keep_alive=True) as server:
        yield server
    fetch.close_idle_connections()


def test_keep_alive_connection_reused(keep_alive_srv: MediaServer, loopback_only: list[str]) -> None:
    for _ in range(3):
        assert fetch_media(keep_alive_srv.url("/a.jpg"), LOOPBACK) == JPEG
    assert keep_alive_srv.num_connections == 1 and loopback_only == ["127.0.0.1"]
    assert keep_alive_srv.requests[-1].headers.get("Connection", "keep-alive") == "keep-alive"


def test_no_reuse_when_server_says_close(srv: MediaServer) -> None:
    num_connections = srv.num_connections
    for _ in range(3):
        assert fetch_media(srv.url("/a.jpg"), LOOPBACK) == JPEG
    assert srv.num_connections == num_connections + 3


def test_reuse_is_per_host_name_and_never_across_a_redirect(keep_alive_srv: MediaServer) -> None:
    other = f"http://media.test:{keep_alive_srv.port}/a.jpg"  # same address and port, another host name
    resolver = fake_resolver({"media.test": ["127.0.0.1"]})
    assert fetch_media(keep_alive_srv.url("/a.jpg"), LOOPBACK) == JPEG
    # hop 1 reuses that connection (same host); its redirect answer closes it; hop 2 needs its own
    assert fetch_media(keep_alive_srv.redirect_url(other), LOOPBACK, resolver=resolver) == JPEG
    assert keep_alive_srv.num_connections == 2
    assert fetch_media(other, LOOPBACK, resolver=resolver) == JPEG
    assert fetch_media(keep_alive_srv.url("/a.jpg"), LOOPBACK) == JPEG  # a new one: the first was closed
    assert keep_alive_srv.num_connections == 3


def test_no_reuse_after_an_unread_answer(keep_alive_srv: MediaServer) -> None:
    with pytest.raises(FetchError, match="HTTP 404"):
        fetch_media(keep_alive_srv.url("/missing"), LOOPBACK)
    assert fetch_media(keep_alive_srv.url("/a.jpg"), LOOPBACK) == JPEG
    assert keep_alive_srv.num_connections == 2


@pytest.mark.parametrize("is_checked", [True, False])
def test_connection_closed_by_server_while_idle(keep_alive_srv: MediaServer, monkeypatch: pytest.MonkeyPatch,
                                                is_checked: bool) -> None:
    """The idle check drops it; when the close slips past the check, the GET is repeated once, fresh."""
    assert fetch_media(keep_alive_srv.url("/a.jpg"), LOOPBACK) == JPEG
    keep_alive_srv.drop_connections()
    if not is_checked:
        from preprocess import http_conn

        monkeypatch.setattr(http_conn, "is_quiet", lambda sock: True)  # the close slips past the idle check
    assert fetch_media(keep_alive_srv.url("/a.jpg"), LOOPBACK) == JPEG
    assert keep_alive_srv.num_connections == 2


@pytest.mark.parametrize("url", [
    "http://user:pw@example.com/a.jpg", "http://exa mple.com/a.jpg", "http://example.com:99999/",
    "http:///a.jpg", "http://example.com/\r\nX-Injected: 1",
])
def test_malformed_urls(url: str) -> None:
    with pytest.raises(FetchError, match="invalid URL"):
        fetch_media(url, PUBLIC_ONLY, resolver=fake_resolver({}))


def test_messages_truncate_long_urls() -> None:
    with pytest.raises(ForbiddenSource) as info:
        fetch_media("http://10.0.0.1/" + "a" * 5000, PUBLIC_ONLY)
    with pytest.raises(FetchError) as info2:
        fetch_media("http://example.com/ " + "a" * 5000, PUBLIC_ONLY)
    assert len(info.value.message) < 300 and len(info2.value.message) < 300


# -------------------------------------------------------------------------------------------- data:


@pytest.mark.parametrize("uri, expected", [
    ("data:image/png;base64,aGVsbG8=", b"hello"),
    ("data:image/png;base64,aGVsbG8", b"hello"),  # missing padding
    ("DATA:;BASE64,aGk=", b"hi"),
    ("data:;base64,", b""),
    ("data:image/png;base64,aGVs%62G8=", b"hello"),  # percent-encoded payload
    ("data:,hello%20world%FF", b"hello world\xff"),
    ("data:text/plain;charset=utf-8,abc", b"abc"),
])
def test_data_uri_good(uri: str, expected: bytes) -> None:
    assert decode_data_uri(uri, 100) == expected
    assert fetch_media(uri, PUBLIC_ONLY) == expected
    check_source(uri, PUBLIC_ONLY)


@pytest.mark.parametrize("uri", [
    "data:;base64,aGVsbG8*", "data:;base64,aGVs bG8=", "data:;base64,aGVsbG8\n", "data:;base64,a",
    "data:;base64,aGVsbG8===", "data:;base64,aG=VsbG8=", "data:;base64,aGVsbG8=\u00e9", "data:;base64,-_-_",
])
def test_data_uri_bad_base64(uri: str) -> None:
    with pytest.raises(FetchError, match="invalid base64 in data: URI"):
        fetch_media(uri, PUBLIC_ONLY)
    with pytest.raises(FetchError, match="invalid base64"):
        check_source(uri, PUBLIC_ONLY)


def test_data_uri_malformed() -> None:
    with pytest.raises(FetchError, match="malformed data: URI"):
        fetch_media("data:image/png;base64", PUBLIC_ONLY)


def test_data_uri_oversized_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    uri = "data:;base64," + base64.b64encode(bytes(1001)).decode()
    assert len(decode_data_uri(uri, 1001)) == 1001
    monkeypatch.setattr(fetch.binascii, "a2b_base64", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(MediaTooLarge, match="limit of 1000 bytes"):
        decode_data_uri(uri, 1000)
    with pytest.raises(MediaTooLarge):
        check_source(uri, FetchPolicy(max_bytes=1000))
    with pytest.raises(MediaTooLarge):
        decode_data_uri("data:," + "a" * 1001, 1000)


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64), st.booleans())
def test_data_uri_roundtrip(payload: bytes, keep_padding: bool) -> None:
    encoded = base64.b64encode(payload).decode()
    uri = "data:application/octet-stream;base64," + (encoded if keep_padding else encoded.rstrip("="))
    assert decode_data_uri(uri, 64) == payload


# -------------------------------------------------------------------------------------------- files


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.jpg").write_bytes(JPEG)
    (tmp_path / "secret.txt").write_bytes(b"secret")
    return root


def test_local_file_inside_allowed_dir(media_dir: Path) -> None:
    policy = FetchPolicy(allowed_local_dir=str(media_dir))
    path = media_dir / "sub" / "a.jpg"
    (media_dir / "link.jpg").symlink_to(path)  # a symlink that stays inside is fine
    for source in (str(path), path.as_uri(), f"file://localhost{path}", str(media_dir / "link.jpg")):
        check_source(source, policy)
        assert fetch_media(source, policy) == JPEG


def test_local_file_escapes_refused(media_dir: Path, tmp_path: Path) -> None:
    policy = FetchPolicy(allowed_local_dir=str(media_dir))
    (media_dir / "escape.txt").symlink_to(tmp_path / "secret.txt")
    (media_dir / "escape_dir").symlink_to(tmp_path)
    (tmp_path / "media2").mkdir()
    (tmp_path / "media2" / "b.jpg").write_bytes(JPEG)  # shares the prefix "media" but is outside
    sources = [
        str(tmp_path / "secret.txt"), f"{media_dir}/../secret.txt", f"{media_dir}/sub/../../secret.txt",
        str(media_dir / "escape.txt"), str(media_dir / "escape_dir" / "secret.txt"),
        f"file://{media_dir}/%2e%2e/secret.txt", str(tmp_path / "media2" / "b.jpg"), "/etc/passwd",
    ]
    for source in sources:
        with pytest.raises(ForbiddenSource, match="outside the allowed local media directory"):
            fetch_media(source, policy)
        with pytest.raises(ForbiddenSource):
            check_source(source, policy)


def test_local_files_disallowed_without_dir(media_dir: Path) -> None:
    for source in (str(media_dir / "sub" / "a.jpg"), (media_dir / "sub" / "a.jpg").as_uri()):
        with pytest.raises(ForbiddenSource, match="local files are not allowed"):
            fetch_media(source, PUBLIC_ONLY)


def test_local_file_errors(media_dir: Path) -> None:
    policy = FetchPolicy(max_bytes=len(JPEG) - 1, allowed_local_dir=str(media_dir))
    os.mkfifo(media_dir / "fifo")
    cases: list[tuple[str, type[MediaError], str]] = [
        (str(media_dir / "nope.jpg"), FetchError, "no such file"),
        (str(media_dir / "sub"), FetchError, "not a regular file"),
        (str(media_dir / "fifo"), FetchError, "not a regular file"),
        (str(media_dir / "sub" / "a.jpg"), MediaTooLarge, "limit of"),
        ("file://otherhost/etc/passwd", ForbiddenSource, "remote host"),
    ]
    for source, error, message in cases:
        with pytest.raises(error, match=message):
            fetch_media(source, policy)
        with pytest.raises(error, match=message):
            check_source(source, policy)


# ------------------------------------------------------------------------------------ other sources


@pytest.mark.parametrize("source, error, message", [
    ("ftp://example.com/a.jpg", ForbiddenSource, "scheme 'ftp' is not allowed"),
    ("gopher://example.com/", ForbiddenSource, "scheme 'gopher'"),
    ("javascript:alert(1)", ForbiddenSource, "scheme 'javascript'"),
    ("FILE2://x", ForbiddenSource, "scheme 'file2'"),
    ("a.jpg", FetchError, "unsupported media source 'a.jpg'"),
    ("../a.jpg", FetchError, "unsupported media source"),
    ("", FetchError, "empty media source"),
    ("   ", FetchError, "empty media source"),
])
def test_unknown_sources(source: str, error: type[MediaError], message: str) -> None:
    with pytest.raises(error, match=message):
        fetch_media(source, PUBLIC_ONLY)
    with pytest.raises(error, match=message):
        check_source(source, PUBLIC_ONLY)


def test_check_source_never_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def numeric_only(*args: object, flags: int = 0, **kwargs: object) -> object:
        assert flags & socket.AI_NUMERICHOST, "check_source did a DNS lookup"
        return real(*args, flags=flags, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", numeric_only)
    check_source("https://images.example.com/a.jpg", PUBLIC_ONLY)
    check_source("http://93.184.216.34/a.jpg", PUBLIC_ONLY)
    check_source("http://localhost/a.jpg", LOOPBACK)
    with pytest.raises(ForbiddenSource):
        check_source("http://foo.localhost./a.jpg", PUBLIC_ONLY)


def test_policy_is_frozen_picklable_and_validated() -> None:
    policy = FetchPolicy(max_bytes=10, allowed_local_dir="/srv/media")
    assert pickle.loads(pickle.dumps(policy)) == policy
    with pytest.raises(AttributeError):
        policy.max_bytes = 11  # type: ignore[misc]
    for bad in ({"max_bytes": 0}, {"timeout_s": 0}, {"max_redirects": -1}):
        with pytest.raises(ValueError):
            FetchPolicy(**bad)  # type: ignore[arg-type]
