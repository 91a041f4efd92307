"""Hostile JSON into the request parsers: a parsed request or a 4xx `ApiError` with a message, nothing else.

Bodies come from hypothesis (random JSON of every shape, and near-valid bodies whose fields hold the wrong
types, huge or non-finite numbers, unicode and huge strings), plus crafted cases: invalid base64 in `data:`
URIs and `input_audio`, a `data:` MIME type of another kind of media, malformed URLs, deep nesting.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encoder_server.api import ApiError, parse_embeddings_request
from encoder_server.chat_api import parse_chat_request, parse_completion_request
from encoder_server.config import PreprocessConfig
from preprocess.fetch import FetchPolicy

POLICY = FetchPolicy(max_bytes=4096)
PREP = PreprocessConfig()
MAX_ITEMS = 8
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

# Scalars a JSON body can carry once parsed (json.loads accepts NaN, Infinity and integers of any size).
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.sampled_from([0, -1, 1, 2**31, 2**63, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.sampled_from(["", "\x00", "\udcff", "é" * 50, "a" * 100_000]),
)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                               max_size=4),
                           max_leaves=20)
URLS = ["http://example.com/a.jpg", "https://[::1", "http://[::1]:99999/", "http://user:pw@example.com/",
        "http://127.0.0.1/", "file:///etc/passwd", "gopher://x/", "ftp://x/", "javascript:alert(1)", "", "//x",
        "data:", "data:,", "data:image/png;base64,", "data:image/png;base64,!!!!", "data:;base64,QUJD=",
        "data:text/html,<script>", "data:image/png;base64," + "A" * 6000, "http://" + "a" * 70_000 + ".com/",
        "http://example.com/\r\nHost: evil", "http://%00/", "http://exa mple.com/"]
urls = st.sampled_from(URLS) | st.text(max_size=60) | st.builds(lambda s: "http://" + s, st.text(max_size=30))
VIDEO_KEYS = ["fps", "nframes", "min_frames", "max_frames", "video_start", "video_end", "min_pixels", "max_pixels",
              "total_pixels"]
numbers = st.sampled_from([0, -1, 1, 2, 0.5, 1e308, float("inf"), float("nan"), 10**400, -(10**400), True, "2"]) \
    | st.integers() | st.floats()


@st.composite
def media_parts(draw: st.DrawFn) -> Any:
    """A content part close enough to a real one to get past the first checks, wrong somewhere."""
    kind = draw(st.sampled_from(["image_url", "video_url", "audio_url", "input_audio", "text", "bogus"]))
    part: dict[str, Any] = {"type": draw(st.sampled_from([kind, kind, None, 3, ["image_url"]]))}
    if kind == "input_audio":
        data = draw(st.sampled_from(["UklGRg==", "!!", "é", "", "QUJD", "A" * 6000]) | st.text(max_size=20))
        part["input_audio"] = draw(st.sampled_from([{"data": data, "format": draw(st.sampled_from(
            ["wav", "mp3", "flac", "ogg", None, 1]))}, data, None, [data]]))
    else:
        url = draw(urls)
        part[kind] = draw(st.sampled_from([{"url": url}, url, {"url": None}, {}, None, [url]]) | json_values)
    if kind == "video_url":
        target = part[kind] if isinstance(part[kind], dict) and draw(st.booleans()) else part
        for key in draw(st.lists(st.sampled_from(VIDEO_KEYS), max_size=3)):
            target[key] = draw(numbers)
    if draw(st.booleans()):
        part["uuid"] = draw(st.sampled_from(["u1", "", "x" * 300, 5, None]) | st.text(max_size=10))
    return part


entries = st.one_of(media_parts(), urls, json_values)


def assert_parsed_or_4xx(parse: Callable[[], Any]) -> None:
    """The only allowed outcomes: a parsed request, or an ApiError with a 4xx status and a message."""
    try:
        parse()
    except ApiError as e:
        assert 400 <= e.status < 500, (e.status, e.message)
        assert isinstance(e.message, str) and e.message
        json.dumps(e.body())  # the error body itself must serialise


def parse_embeddings(body: Any) -> None:
    assert_parsed_or_4xx(lambda: parse_embeddings_request(body, POLICY, MAX_ITEMS, PREP))


def parse_chat(body: Any) -> None:
    assert_parsed_or_4xx(lambda: parse_chat_request(body, POLICY, PREP, MAX_ITEMS, 1024))


def parse_completion(body: Any) -> None:
    assert_parsed_or_4xx(lambda: parse_completion_request(body, 1024, 32000))


@FUZZ
@given(json_values)
def test_any_json_value(body: Any) -> None:
    parse_embeddings(body)
    parse_chat(body)
    parse_completion(body)


@FUZZ
@given(st.one_of(entries, st.lists(entries, max_size=10)),
       st.fixed_dictionaries({}, optional={"encoding_format": json_values | st.sampled_from(["float", "base64"]),
                                           "pooling": json_values | st.sampled_from(["mean", "none"]),
                                           "model": json_values}))
def test_embeddings_bodies(input_: Any, extra: dict[str, Any]) -> None:
    parse_embeddings({"input": input_, **extra})


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer",
                                                                     "tool", None, 1])},
                                          optional={"content": st.one_of(
                                              st.text(max_size=20), json_values,
                                              st.lists(media_parts() | st.fixed_dictionaries(
                                                  {"type": st.just("text"), "text": scalars}), max_size=5))}),
                    max_size=4)
sampling = st.fixed_dictionaries({}, optional={name: numbers | json_values for name in (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "stop", "stream", "stream_options")})


@FUZZ
@given(messages | json_values, sampling)
def test_chat_bodies(messages_: Any, extra: dict[str, Any]) -> None:
    parse_chat({"messages": messages_, **extra})


@FUZZ
@given(st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 40000) | scalars, max_size=8), json_values), sampling)
def test_completion_bodies(prompt: Any, extra: dict[str, Any]) -> None:
    parse_completion({"prompt": prompt, **extra})


def _status(parse: Callable[[], Any]) -> int:
    with pytest.raises(ApiError) as info:
        parse()
    assert info.value.message
    return info.value.status


@pytest.mark.parametrize("uri", [
    "data:image/png;base64,!!!!", "data:image/png;base64,QUJDR", "data:image/png;base64,QUJD===",
    "data:image/png;base64,QU=JD", "data:image/png;base64,\u00e9\u00e9\u00e9\u00e9", "data:image/png;base64",
    "data:image/png;base64,%ZZ", "data:image/png;base64," + "QUJD" * 2000,  # above the 4096-byte limit: 413
])
def test_invalid_base64_data_uri(uri: str) -> None:
    status = _status(lambda: parse_embeddings_request({"input": uri}, POLICY, MAX_ITEMS, PREP))
    assert status == (413 if len(uri) > 6000 else 400)


@pytest.mark.parametrize("data", ["!!!!", "QUJ", "QU JD", "\u00e9", "QUJD" * 2000])
def test_invalid_input_audio(data: str) -> None:
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    status = _status(lambda: parse_embeddings_request({"input": [part]}, POLICY, MAX_ITEMS, PREP))
    assert status == (413 if len(data) > 6000 else 400)


@pytest.mark.parametrize(("kind", "mime"), [("image_url", "text/html"), ("image_url", "audio/wav"),
                                            ("video_url", "image/png"), ("audio_url", "video/mp4"),
                                            ("image_url", "text/plain;charset=utf-8")])
def test_data_uri_of_another_media_type_is_415(kind: str, mime: str) -> None:
    uri = f"data:{mime};base64," + base64.b64encode(b"<html><script>alert(1)</script>").decode()
    body = {"input": [{"type": kind, kind: {"url": uri}}]}
    assert _status(lambda: parse_embeddings_request(body, POLICY, MAX_ITEMS, PREP)) == 415
    chat = {"messages": [{"role": "user", "content": [{"type": kind, kind: {"url": uri}}]}]}
    assert _status(lambda: parse_chat_request(chat, POLICY, PREP, MAX_ITEMS, 64)) == 415


@pytest.mark.parametrize("mime", ["", "image/png", "application/octet-stream", "IMAGE/JPEG"])
def test_data_uri_of_the_right_or_generic_type_parses(mime: str) -> None:
    uri = f"data:{mime};base64," + base64.b64encode(b"\x89PNG whatever").decode()
    req = parse_embeddings_request({"input": [uri]}, POLICY, MAX_ITEMS, PREP)
    assert req.inline[0] == b"\x89PNG whatever"


# Bugs these tests found (each was an OverflowError or ValueError, i.e. a 500, before the fix).
@pytest.mark.parametrize("body", [
    {"input": {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}, "nframes": float("inf")}},
    {"input": {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4", "fps": 10**400}}},
    {"input": {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}, "video_start": -(10**400)}},
    {"input": {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}, "max_pixels": 10**400}},
    {"input": "http://[::1"},
    {"input": "https://[not-an-ip]/a.jpg"},
])
def test_found_embeddings_bugs_are_400(body: dict[str, Any]) -> None:
    assert _status(lambda: parse_embeddings_request(body, POLICY, MAX_ITEMS, PREP)) == 400


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [10**400, -(10**400), float("inf"), float("nan")])
def test_found_chat_bugs_are_400(field: str, value: Any) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], field: value}
    assert _status(lambda: parse_chat_request(chat, POLICY, PREP, MAX_ITEMS, 64)) == 400
    assert _status(lambda: parse_completion_request({"prompt": "hi", field: value}, 64, 100)) == 400


def test_huge_and_deep_inputs() -> None:
    deep: Any = "http://example.com/a.jpg"
    for _ in range(50_000):  # nesting the parsers never recurse into
        deep = [deep]
    chat_deep: Any = {"type": "text", "text": "x"}
    for _ in range(50_000):
        chat_deep = {"type": "image_url", "image_url": chat_deep}
    huge = "x" * (4 << 20)
    for parse in (
        lambda: parse_embeddings_request({"input": [deep]}, POLICY, MAX_ITEMS, PREP),
        lambda: parse_embeddings_request({"input": list(range(100_000))}, POLICY, MAX_ITEMS, PREP),
        lambda: parse_embeddings_request({"input": ["http://example.com/a.jpg"] * 9}, POLICY, MAX_ITEMS, PREP),
        lambda: parse_embeddings_request({"input": [{"type": "image_url", "uuid": huge}]}, POLICY, MAX_ITEMS, PREP),
        lambda: parse_embeddings_request({"input": "data:image/png;base64," + huge}, POLICY, MAX_ITEMS, PREP),
        lambda: parse_chat_request({"messages": [{"role": "user", "content": [chat_deep]}]}, POLICY, PREP, 8, 64),
        lambda: parse_chat_request({"messages": [{"role": "user", "content": "x"}] * 10, "stop": [huge]}, POLICY,
                                   PREP, 8, 64),
        lambda: parse_completion_request({"prompt": [1] * 100_000 + [10**400]}, 64, 100),
    ):
        assert 400 <= _status(parse) < 500
    # a huge text prompt is the engine's to bound (by tokens); the parser accepts it without copying it around
    assert parse_completion_request({"prompt": huge}, 64, 100).generate.prompt_text is huge
