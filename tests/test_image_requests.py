"""Images in the three APIs' request bodies and image URLs, without a model (fast):
- Anthropic `image` blocks (base64 -> a data URI part; url only with --allow-image-urls; file refused) in user
  messages and inside tool_result content, refused elsewhere, each refusal naming the block;
- Responses `input_image` parts (data URI; http(s) only with the flag; file_id refused; detail accepted) in user
  messages and function_call_output, refused elsewhere; a compaction's output keeps the images as input_image;
- chat `image_url` URLs refused at parse without the flag, naming the part;
- ImageFetcher against a local http.server: the image; redirects up to the bound; a redirect to file://, a 404, a
  declared or streamed body past the byte cap, a stalled host, a content encoding, a closed port all refused in
  one line; the CLI's image flags.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.cli import build_parser, image_options
from tandem.image_fetch import ImageFetcher, is_image_url
from tandem.images import ImageError, ImageLimits
from tandem.multimodal import part_bytes
from tandem.server import anthropic_request, responses_request
from tandem.server.errors import APIError
from tandem.server.protocol import parse_chat
from tandem.server.responses_compact import compacted_output

pytest.importorskip("PIL.Image")
pytest.importorskip("httpx")
from image_corpus import ImageHost, png  # noqa: E402

B64 = "iVBORw0KGgo="
URI = "data:image/png;base64," + B64


def _refused(fn: Any, *args: Any, **kwargs: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


def _anthropic(content: Any, allow: bool = False, role: str = "user") -> list[dict[str, Any]]:
    body = {"max_tokens": 4, "messages": [{"role": role, "content": content}]}
    return anthropic_request.to_chat_body(body, {}, False, allow_image_urls=allow)[0]["messages"]


def test_anthropic_image_blocks_become_image_parts() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64},
             "cache_control": {"type": "ephemeral"}}
    got = _anthropic([{"type": "text", "text": "a"}, image, {"type": "text", "text": "b"}, {"type": "text", "text": "c"}])
    assert got == [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": URI}},
                                                {"type": "text", "text": "bc"}]}]
    result = {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
              "content": [{"type": "text", "text": "shot:"}, image]}
    got = _anthropic([result, {"type": "text", "text": "go on"}])
    assert got == [{"role": "tool", "tool_call_id": "t1", "content": [
        {"type": "text", "text": "error: shot:"}, {"type": "image_url", "image_url": {"url": URI}}]},
        {"role": "user", "content": "go on"}]
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    assert _anthropic([url], allow=True)[0]["content"] == [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]


@pytest.mark.parametrize("content,role,param,match", [
    ([{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}], "user",
     "messages[0].content[0]", "--allow-image-urls"),
    ([{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/a.png"}}]}], "user",
     "messages[0].content[0].content[0]", "--allow-image-urls"),
    ([{"type": "image", "source": {"type": "file", "file_id": "file_1"}}], "user", "messages[0].content[0]",
     "Files API"),
    ([{"type": "image", "source": {"type": "url", "url": "ftp://example.com/a.png"}}], "user",
     "messages[0].content[0].source.url", "http"),
    ([{"type": "image", "source": {"type": "base64", "media_type": "text/html", "data": B64}}], "user",
     "messages[0].content[0].source.media_type", "image type"),
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/png,x", "data": B64}}], "user",
     "messages[0].content[0].source.media_type", "image type"),
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/png"}}], "user",
     "messages[0].content[0].source.data", "base64"),
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}], "assistant",
     "messages[0].content[0]", "user messages and tool results only"),
], ids=["url-off", "url-in-tool-result-off", "file", "ftp", "media-type", "media-type-injection", "no-data",
        "assistant"])
def test_anthropic_image_refusals_name_the_block(content: Any, role: str, param: str, match: str) -> None:
    err = _refused(_anthropic, content, role=role)
    assert err.param == param and match in err.message


def test_anthropic_image_in_system_is_refused() -> None:
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
            "system": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}]}
    assert _refused(anthropic_request.to_chat_body, body, {}, False).param == "system[0]"


def _responses(items: Any, allow: bool = False) -> list[dict[str, Any]]:
    return responses_request.to_chat_body({"input": items}, [], False, allow_image_urls=allow)[0]["messages"]


def test_responses_input_image_becomes_image_parts() -> None:
    got = _responses([{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                   {"type": "input_image", "image_url": URI, "detail": "low"}]}])
    assert got == [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": URI}}]}]
    items = [{"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1",
              "output": [{"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": URI}]}]
    assert _responses(items)[1] == {"role": "tool", "tool_call_id": "c1", "content": [
        {"type": "text", "text": "here"}, {"type": "image_url", "image_url": {"url": URI}}]}
    url = [{"role": "user", "content": [{"type": "input_image", "image_url": "HTTPS://example.com/a.png"}]}]
    assert _responses(url, allow=True)[0]["content"][0]["image_url"]["url"] == "HTTPS://example.com/a.png"


@pytest.mark.parametrize("part,role,match", [
    ({"type": "input_image", "image_url": "https://example.com/a.png", "detail": "high"}, "user",
     "--allow-image-urls"),
    ({"type": "input_image", "file_id": "file-1"}, "user", "Files API"),
    ({"type": "input_image", "detail": "auto"}, "user", "image_url"),
    ({"type": "input_image", "image_url": "/etc/passwd"}, "user", "data URI"),
    ({"type": "input_image", "image_url": URI}, "system", "user messages"),
    ({"type": "input_image", "image_url": URI}, "assistant", "user messages"),
    ({"type": "input_file", "file_id": "file-1"}, "user", "not supported"),
], ids=["url-off", "file-id", "no-url", "not-a-uri", "system", "assistant", "input-file"])
def test_responses_image_refusals_name_the_part(part: dict[str, Any], role: str, match: str) -> None:
    err = _refused(_responses, [{"role": role, "content": [{"type": "input_text", "text": "a"}, part]}])
    assert err.param == "input[0].content[1]" and match in err.message


def test_compaction_output_keeps_images_as_input_image() -> None:
    conversation = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                 {"type": "image_url", "image_url": {"url": URI}}]}]
    users = compacted_output(conversation, "summary")[0]
    assert users["content"] == [{"type": "input_text", "text": "see"},
                                {"type": "input_image", "image_url": URI, "detail": "auto"}]


def test_chat_image_urls_refused_at_parse_without_the_flag() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                      {"type": "image_url", "image_url": {"url": "http://a/b.png"}}]}]}
    err = _refused(parse_chat, body)
    assert err.param == "messages[0].content[1]" and "--allow-image-urls" in err.message
    req = parse_chat(body, allow_image_urls=True)
    assert req.messages is not None and req.messages[0]["content"][1]["image_url"]["url"] == "http://a/b.png"
    assert is_image_url("HTTP://x") and not is_image_url("data:image/png;base64,AA") and not is_image_url(None)


# ------------------------------------------------------------------------------------------ fetching URLs
IMG = png(40, 30)


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    h = ImageHost({"/img.png": IMG, "/big.png": bytes(5000)}, slow_s=2.0)
    yield h
    h.close()


def test_fetch_reads_the_image_and_follows_bounded_redirects(host: ImageHost) -> None:
    fetcher = ImageFetcher(timeout_s=5, max_redirects=3)
    assert fetcher.fetch(host.url("/img.png"), 10_000) == IMG
    assert fetcher.fetch(host.url("/redirect/3"), 10_000) == IMG
    with pytest.raises(ImageError, match="more than 3 redirects"):
        fetcher.fetch(host.url("/redirect/4"), 10_000)
    with pytest.raises(ImageError, match="not http"):
        fetcher.fetch(host.url("/to-file"), 10_000)
    fetched = part_bytes({"type": "image_url", "image_url": {"url": host.url("/img.png")}}, ImageLimits(), fetcher)
    assert fetched == IMG


@pytest.mark.parametrize("path,match", [
    ("/missing.png", "answered 404"), ("/big.png", "5000 bytes; the limit is 4096"),
    ("/declared-huge", "10000000000 bytes"), ("/endless", "over the 4096-byte limit"), ("/gzip", "gzip-encoded"),
])
def test_fetch_refusals(host: ImageHost, path: str, match: str) -> None:
    with pytest.raises(ImageError, match=match):
        ImageFetcher(timeout_s=5).fetch(host.url(path), 4096)


def test_fetch_times_out_and_refuses_other_urls(host: ImageHost) -> None:
    t0 = time.monotonic()
    with pytest.raises(ImageError, match="no answer within 0.5 s"):
        ImageFetcher(timeout_s=0.5).fetch(host.url("/slow/img.png"), 10_000)
    assert time.monotonic() - t0 < 1.9  # cut by the timeout, not the host's 2 s
    with pytest.raises(ImageError, match="not an http"):
        ImageFetcher().fetch("file:///etc/hostname", 10_000)
    closed = ImageHost({})
    url = closed.url("/img.png")
    closed.close()
    with pytest.raises(ImageError, match="failed"):
        ImageFetcher(timeout_s=2).fetch(url, 10_000)


def test_serve_image_flags() -> None:
    args = build_parser().parse_args(["serve", "--allow-image-urls", "--max-images", "2", "--max-image-mb", "0.5"])
    opts = image_options(args)
    assert opts["allow_image_urls"] is True
    assert opts["image_limits"] == ImageLimits(max_images=2, max_bytes=512 * 1024)
    default = image_options(build_parser().parse_args(["serve"]))
    assert default == {"allow_image_urls": False, "image_limits": ImageLimits()}
    with pytest.raises(ValueError, match="--max-images"):
        image_options(build_parser().parse_args(["serve", "--max-images", "0"]))
