"""Image mixes for `mmenc bench serve`, and the local HTTP server that serves them.

A mix is a weighted set of image sizes (`--mix 448|1080p|4k|mixed`, or a custom spec such as
`224`, `640x480` or `448=0.5,1080p=0.5`). Each size gets `distinct` different photo-like JPEGs
(`bench.preprocess.make_jpegs`). Every request can also get bytes of its own: `with_nonce` puts a
JPEG comment segment carrying a counter into the file, which changes its content hash (so neither a
URL-keyed nor a content-keyed cache can answer from memory) but not the pixels or the decode work.

The media server runs in a child process (its own GIL, so serving 4K JPEGs does not disturb the
load generator's timing): `/img/<size>/<i>.jpg?n=<nonce>` answers image `i` of that size.
"""

from __future__ import annotations

import base64
import http.server
import json
import multiprocessing as mp
import random
import struct
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from urllib.parse import parse_qs, urlsplit

from bench.preprocess import make_jpegs

SIZES: dict[str, tuple[int, int]] = {"448": (448, 448), "1080p": (1920, 1080), "4k": (3840, 2160)}
MIXES: dict[str, str] = {"mixed": "448=0.5,1080p=0.4,4k=0.1"}
_PARALLEL_GENERATION_PIXELS = 16_000_000  # generate in a process pool above this many pixels in total


def _parse_size(text: str) -> tuple[int, int]:
    if text in SIZES:
        return SIZES[text]
    width, _, height = text.partition("x")
    size = (int(width), int(height or width))
    if min(size) < 200:  # make_jpegs draws shapes up to 200 px from a random corner
        raise ValueError(f"image size {text!r}: both sides must be >= 200 px")
    return size


@dataclass(frozen=True)
class ImageMix:
    """Weighted image sizes: `labels[i]` is `sizes[i]` (width, height), drawn with probability `weights[i]`."""

    name: str
    labels: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.labels or len(self.labels) != len(self.sizes) or len(self.sizes) != len(self.weights):
            raise ValueError(f"mix {self.name!r}: needs as many sizes as weights, at least one")
        if any(w <= 0 for w in self.weights):
            raise ValueError(f"mix {self.name!r}: weights must be > 0")

    @classmethod
    def parse(cls, spec: str) -> ImageMix:
        """`448`, `1080p`, `4k`, `mixed`, `WxH`, `S` (square) or `size=weight,...` (weights are normalized).

        Raises:
            ValueError: a size that does not parse, is too small, or a weight <= 0.
        """
        text = MIXES.get(spec, spec)
        labels, sizes, weights = [], [], []
        for part in text.split(","):
            label, _, weight = part.strip().partition("=")
            try:
                sizes.append(_parse_size(label))
                weights.append(float(weight or 1.0))
            except ValueError as e:
                raise ValueError(f"--mix {spec!r}: {e}") from None
            labels.append(label)
        if any(w <= 0 for w in weights):
            raise ValueError(f"--mix {spec!r}: weights must be > 0")
        total = sum(weights)
        return cls(spec, tuple(labels), tuple(sizes), tuple(w / total for w in weights))

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "sizes": {lbl: {"width": s[0], "height": s[1], "weight": round(w, 4)}
                                             for lbl, s, w in zip(self.labels, self.sizes, self.weights, strict=True)}}


def _one_jpeg(args: tuple[int, int, int]) -> bytes:
    width, height, seed = args
    return make_jpegs(1, width, height, seed=seed)[0]


def generate_images(mix: ImageMix, distinct: int, seed: int = 0) -> dict[str, list[bytes]]:
    """`distinct` different JPEGs per size of `mix` (seeded; in a process pool when there is much to draw)."""
    jobs = [(w, h, seed * 1_000_003 + k * 10_007 + i) for k, (w, h) in enumerate(mix.sizes) for i in range(distinct)]
    if sum(w * h for w, h, _ in jobs) > _PARALLEL_GENERATION_PIXELS:
        with ProcessPoolExecutor(mp_context=mp.get_context("spawn")) as pool:
            blobs = list(pool.map(_one_jpeg, jobs))
    else:
        blobs = [_one_jpeg(job) for job in jobs]
    return {label: blobs[k * distinct:(k + 1) * distinct] for k, label in enumerate(mix.labels)}


def with_nonce(jpeg: bytes, nonce: int) -> bytes:
    """`jpeg` with a COM segment holding `nonce` after SOI (and after the JFIF APP0 segment if present)."""
    pos = 2
    if jpeg[2:4] == b"\xff\xe0":
        pos = 4 + struct.unpack(">H", jpeg[4:6])[0]
    payload = b"mmenc-bench %d" % nonce
    return jpeg[:pos] + b"\xff\xfe" + struct.pack(">H", len(payload) + 2) + payload + jpeg[pos:]


class RequestFactory:
    """Builds `/v1/embeddings` bodies: images drawn from the mix with a seeded RNG (the same sequence for
    every factory with the same seed), each size's images in turn, as URLs on `media` or as data URIs.

    Args:
        nonces: shared counter; with `is_unique`, every image sent gets the next value in its bytes.
    """

    def __init__(self, mix: ImageMix, images: dict[str, list[bytes]], media: MediaServer | None,
                 items_per_request: int, *, is_data_uri: bool, is_unique: bool, encoding_format: str,
                 nonces: Iterator[int], seed: int = 0, pooling: str | None = None) -> None:
        self.mix, self.images, self.media = mix, images, media
        self.pooling = pooling
        self.items_per_request, self.is_data_uri, self.is_unique = items_per_request, is_data_uri, is_unique
        self.encoding_format, self.nonces = encoding_format, nonces
        self._rng = random.Random(seed)
        self._next = dict.fromkeys(mix.labels, 0)

    def _source(self) -> str:
        label = self._rng.choices(self.mix.labels, self.mix.weights)[0]
        index = self._next[label]
        self._next[label] = (index + 1) % len(self.images[label])
        nonce = next(self.nonces) if self.is_unique else None
        if not self.is_data_uri:
            assert self.media is not None
            return self.media.url(label, index, nonce)
        blob = self.images[label][index]
        blob = with_nonce(blob, nonce) if nonce is not None else blob
        return "data:image/jpeg;base64," + base64.b64encode(blob).decode()

    def __call__(self) -> tuple[bytes, int]:
        """(JSON body, number of images)."""
        inputs = [self._source() for _ in range(self.items_per_request)]
        body = {"input": inputs, "encoding_format": self.encoding_format}
        if self.pooling:
            body["pooling"] = self.pooling
        return json.dumps(body).encode(), len(inputs)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    images: dict[str, list[bytes]] = {}

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        parts = urlsplit(self.path)
        segments = parts.path.strip("/").split("/")
        body = None
        if len(segments) == 3 and segments[0] == "img" and segments[2].endswith(".jpg"):
            blobs = self.images.get(segments[1], [])
            index = segments[2].removesuffix(".jpg")
            if index.isdigit() and int(index) < len(blobs):
                body = blobs[int(index)]
                nonce = parse_qs(parts.query).get("n")
                if nonce and nonce[-1].isdigit():
                    body = with_nonce(body, int(nonce[-1]))
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "image/jpeg" if body is not None else "text/plain")
        payload = body if body is not None else b"not found\n"
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(payload)
        except (ConnectionError, TimeoutError):
            pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the default listen backlog of 5 drops SYNs under a burst of fetches


def _serve(images: dict[str, list[bytes]], host: str, conn: Connection) -> None:
    _Handler.images = images
    httpd = _Server((host, 0), _Handler)
    conn.send(httpd.server_address[1])
    httpd.serve_forever(poll_interval=0.2)


class MediaServer:
    """Serves `images` (size label -> JPEGs) from a child process on `host` at an ephemeral port."""

    def __init__(self, images: dict[str, list[bytes]], host: str = "127.0.0.1") -> None:
        self.images, self.host = images, host
        self._proc: mp.process.BaseProcess | None = None
        self.port = 0

    def start(self) -> MediaServer:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_serve, args=(self.images, self.host, child), name="bench-media",
                                 daemon=True)
        self._proc.start()
        if not parent.poll(60):
            self.stop()
            raise RuntimeError("media server did not start within 60 s")
        self.port = parent.recv()
        return self

    def url(self, label: str, index: int, nonce: int | None = None) -> str:
        query = f"?n={nonce}" if nonce is not None else ""
        return f"http://{self.host}:{self.port}/img/{label}/{index}.jpg{query}"

    def stop(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._proc = None

    def __enter__(self) -> MediaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
