"""`tandem serve` reads images through the official `openai` and `anthropic` clients, on every route:
- chat `image_url`, Anthropic `image` (base64) and Responses `input_image` requests for one image give the same
  prompt ids and the same greedy tokens (the chat request's tokens equal the engine's in-process); count_tokens
  and /tokenize count the image's tokens;
- with `--allow-image-urls`, the same image named by an http:// URL on a local http.server gives the same prompt
  and tokens on each route; a failed fetch is a 400; two requests whose image host stalls hold up no other request;
- without the flag, an image URL is a 400 naming the part on each route;
- the bad-image corpus (tests/image_corpus.py) and the image count and byte limits are 400s on each route;
- a JSON schema and a forced tool call hold with an image in the prompt (chat and Messages);
- a model without a vision tower refuses images; after every refusal the server keeps serving.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import REPO_ROOT, ServerProcess
from tandem.engine import Engine
from tandem.image_fetch import ImageFetcher
from tandem.sampling import SamplingParams
from tandem.server import anthropic_request, responses_request
from tandem.server.protocol import parse_chat
from tandem.server.runner import render_prompt

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.slow  # the image path has no compiled module: the interpreted pass only
from hf_reference import write_hf_vl_checkpoint  # noqa: E402
from image_corpus import ImageHost, bad_images, data_uri, png  # noqa: E402

IMG = png(60, 44, 1)
NO_THINKING = {"enable_thinking": False}  # what Anthropic's absent `thinking` and Responses' effort "none" send


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_vl_checkpoint(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def engine(vl_model: Path) -> Engine:
    return Engine.from_pretrained(vl_model, max_context=1024, cache="off")


@pytest.fixture(scope="module")
def server(vl_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(vl_model, "--max-context", "1024", "--vision", "on", "--served-model-name", "toy")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    h = ImageHost({"/img.png": IMG, "/big.png": png(640, 640, 3)}, slow_s=2.0)
    yield h
    h.close()


@pytest.fixture(scope="module")
def url_server(vl_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(vl_model, "--max-context", "1024", "--vision", "on", "--served-model-name", "toy",
                         "--allow-image-urls", "--max-images", "4", "--max-image-mb", "1")
    try:
        yield proc
    finally:
        proc.stop()


def _oai(proc: ServerProcess) -> Any:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)


def _ant(proc: ServerProcess) -> Any:
    return anthropic.Anthropic(base_url=proc.url, api_key="none", max_retries=0)


def _messages(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "this picture?"}]}]


def _ant_messages(image: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in"}, image,
                                         {"type": "text", "text": "this picture?"}]}]


def _ant_base64(data: bytes) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def _input(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "input_text", "text": "What is in"},
                                         {"type": "input_image", "image_url": url, "detail": "auto"},
                                         {"type": "input_text", "text": "this picture?"}]}]


def _three(proc: ServerProcess, url: str, ant_image: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The same one-image question through chat, Messages and Responses (thinking off, greedy, 16 tokens)."""
    chat = _oai(proc).chat.completions.create(model="toy", messages=_messages(url), max_tokens=16, temperature=0,
                                              logprobs=True, extra_body={"chat_template_kwargs": NO_THINKING})
    msg = _ant(proc).messages.create(model="toy", max_tokens=16, messages=_ant_messages(ant_image),
                                    extra_body={"temperature": 0})
    resp = _oai(proc).responses.create(model="toy", input=_input(url), max_output_tokens=16, temperature=0,
                                       reasoning={"effort": "none"})
    return chat, msg, resp


def _same_answer(chat: Any, msg: Any, resp: Any, num_prompt: int) -> None:
    text = chat.choices[0].message.content
    assert chat.usage.prompt_tokens == num_prompt
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == num_prompt
    assert resp.usage.input_tokens == num_prompt
    assert msg.usage.output_tokens == resp.usage.output_tokens == chat.usage.completion_tokens
    assert "".join(b.text for b in msg.content if b.type == "text") == text and resp.output_text == text


def test_three_apis_read_an_image_alike(server: ServerProcess, engine: Engine) -> None:
    uri = data_uri(IMG)
    ids, images = engine.encode_prompt_images(_messages(uri), None, NO_THINKING)
    assert len(images) == 1
    # the same prompt ids: each API's body becomes the chat request that renders to these ids
    ant_body, _ = anthropic_request.to_chat_body({"max_tokens": 16, "messages": _ant_messages(_ant_base64(IMG))},
                                                 {}, False)
    resp_body, _, _ = responses_request.to_chat_body({"input": _input(uri), "reasoning": {"effort": "none"}}, [],
                                                     False)
    for body in (ant_body, resp_body):
        assert render_prompt(engine, parse_chat(body)) == ids
    chat, msg, resp = _three(server, uri, _ant_base64(IMG))
    want = engine.complete(_messages(uri), SamplingParams(temperature=0.0, max_tokens=16),
                           chat_template_kwargs=NO_THINKING)
    assert [e.token for e in chat.choices[0].logprobs.content] == [engine.tokenizer.decode([t])  # type: ignore[union-attr]
                                                                   for t in want.token_ids]
    _same_answer(chat, msg, resp, len(ids))
    counted = _ant(server).messages.count_tokens(model="toy", messages=_ant_messages(_ant_base64(IMG)))
    assert counted.input_tokens == len(ids)
    tokenized = server.request("POST", "/tokenize", json={"messages": _messages(uri),
                                                          "chat_template_kwargs": NO_THINKING}).json()
    assert tokenized["tokens"] == ids


def test_image_urls_are_fetched_with_the_flag(url_server: ServerProcess, host: ImageHost, engine: Engine) -> None:
    url = host.url("/img.png")
    ids, _ = engine.encode_prompt_images(_messages(data_uri(IMG)), None, NO_THINKING)
    ant_url = {"type": "image", "source": {"type": "url", "url": url}}
    inline = _oai(url_server).chat.completions.create(model="toy", messages=_messages(data_uri(IMG)), max_tokens=16,
                                                      temperature=0, extra_body={"chat_template_kwargs": NO_THINKING})
    fetched = _three(url_server, url, ant_url)
    _same_answer(*fetched, len(ids))
    assert fetched[0].choices[0].message.content == inline.choices[0].message.content
    counted = _ant(url_server).messages.count_tokens(model="toy", messages=_ant_messages(ant_url))
    assert counted.input_tokens == len(ids)
    tokenized = url_server.request("POST", "/tokenize", json={"messages": _messages(url),
                                                              "chat_template_kwargs": NO_THINKING}).json()
    assert tokenized["tokens"] == ids
    try:  # the Engine's own option fetches in-process
        engine.image_fetcher = ImageFetcher()
        assert engine.encode_prompt_images(_messages(url), None, NO_THINKING)[0] == ids
    finally:
        engine.image_fetcher = None


@pytest.mark.parametrize("path,match", [("/missing.png", "answered 404"), ("/to-file", "not http"),
                                        ("/big.png", "limit is 1048576"), ("/redirect/4", "more than 3 redirects")])
def test_failed_fetches_are_400(url_server: ServerProcess, host: ImageHost, path: str, match: str) -> None:
    url = host.url(path)
    with pytest.raises(openai.BadRequestError, match=f"image 0: fetching .*{match}"):
        _oai(url_server).chat.completions.create(model="toy", messages=_messages(url), max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match=match):
        _ant(url_server).messages.create(model="toy", max_tokens=4, messages=_ant_messages(
            {"type": "image", "source": {"type": "url", "url": url}}))
    with pytest.raises(openai.BadRequestError, match=match):
        _oai(url_server).responses.create(model="toy", input=_input(url), max_output_tokens=16)


def test_a_stalled_image_host_holds_up_no_other_request(url_server: ServerProcess, host: ImageHost) -> None:
    slow: list[int] = []

    def fetch_slowly() -> None:
        r = url_server.request("POST", "/v1/chat/completions", json={
            "model": "toy", "messages": _messages(host.url("/slow/img.png")), "max_tokens": 2})
        slow.append(r.status_code)

    threads = [threading.Thread(target=fetch_slowly) for _ in range(2)]  # as many as the preparation threads
    for t in threads:
        t.start()
    hits = host.hits
    while host.hits < hits + 2 and all(t.is_alive() for t in threads):
        threading.Event().wait(0.02)  # both fetches reached the host
    ok = _oai(url_server).chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
    assert ok.choices[0].finish_reason is not None
    assert all(t.is_alive() for t in threads)  # the plain request finished while both fetches waited
    for t in threads:
        t.join(30)
    assert slow == [200, 200]


ROUTES: dict[str, Callable[[ServerProcess, str], Any]] = {
    "chat": lambda p, uri: _oai(p).chat.completions.create(model="toy", messages=_messages(uri), max_tokens=4),
    "messages": lambda p, uri: _ant(p).messages.create(model="toy", max_tokens=4, messages=_ant_messages(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": uri.split(",", 1)[1]}})),
    "responses": lambda p, uri: _oai(p).responses.create(model="toy", input=_input(uri), max_output_tokens=16),
}
ERRORS = {"chat": openai.BadRequestError, "messages": anthropic.BadRequestError,
          "responses": openai.BadRequestError}


def _each_route_refuses(proc: ServerProcess, uri: str, match: str) -> None:
    for name, send in ROUTES.items():
        with pytest.raises(ERRORS[name], match=match):
            send(proc, uri)
    ok = _oai(proc).chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason is not None


@pytest.mark.parametrize("name", [name for name, _, _ in bad_images()])
def test_bad_images_are_400_on_every_route(server: ServerProcess, name: str) -> None:
    data, match = next((d, m) for n, d, m in bad_images() if n == name)
    pattern = f"image 0: .*({match})"
    if not data:  # an empty base64 source is refused by the Messages parser, naming it
        pattern += r"|messages\[0\]\.content\[1\]\.source\.data"
    _each_route_refuses(server, data_uri(data), pattern)


def test_image_limits_are_400_on_every_route(url_server: ServerProcess) -> None:
    _each_route_refuses(url_server, data_uri(png(640, 640, 3)), "limit")  # --max-image-mb 1
    many = data_uri(png(16, 16))
    content = [{"type": "image_url", "image_url": {"url": many}}] * 5  # --max-images 4
    with pytest.raises(openai.BadRequestError, match="5 images; the limit is 4"):
        _oai(url_server).chat.completions.create(model="toy", messages=[{"role": "user", "content": content}],
                                                 max_tokens=2)
    with pytest.raises(anthropic.BadRequestError, match="5 images; the limit is 4"):
        _ant(url_server).messages.create(model="toy", max_tokens=2, messages=[
            {"role": "user", "content": [_ant_base64(png(16, 16))] * 5}])
    with pytest.raises(openai.BadRequestError, match="5 images; the limit is 4"):
        _oai(url_server).responses.create(model="toy", max_output_tokens=16, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": many}] * 5}])


def test_image_urls_without_the_flag_are_400_naming_the_part(server: ServerProcess) -> None:
    url = "http://127.0.0.1:9/cat.png"
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\].*--allow-image-urls"):
        _oai(server).chat.completions.create(model="toy", messages=_messages(url), max_tokens=4)
    ant_url = _ant_messages({"type": "image", "source": {"type": "url", "url": url}})
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\].*--allow-image-urls"):
        _ant(server).messages.create(model="toy", max_tokens=4, messages=ant_url)
    with pytest.raises(anthropic.BadRequestError, match="--allow-image-urls"):
        _ant(server).messages.count_tokens(model="toy", messages=ant_url)
    with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.content\[1\].*--allow-image-urls"):
        _oai(server).responses.create(model="toy", input=_input(url), max_output_tokens=16)
    r = server.request("POST", "/tokenize", json={"messages": _messages(url)})
    assert r.status_code == 400 and "--allow-image-urls" in r.text


@pytest.mark.parametrize("url,match", [("data:image/png;base64,iVBORw0KGgo=", "image 0"),
                                       ("data:image/png;base64,%%%", "base64")])
def test_bad_data_uris_are_400(server: ServerProcess, url: str, match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        _oai(server).chat.completions.create(model="toy", messages=_messages(url), max_tokens=4)


def test_model_without_vision_refuses_images() -> None:
    # the embedded model with its tower left out (--vision off): the same refusal as a checkpoint without one
    proc = ServerProcess(REPO_ROOT / "tandem" / "assets" / "default", "--max-context", "1024",
                         "--served-model-name", "toy", "--vision", "off")
    try:
        with pytest.raises(openai.BadRequestError, match="reads no images"):
            _oai(proc).chat.completions.create(model="toy", messages=_messages(data_uri(png(32, 32, 2))), max_tokens=4)
        assert httpx.get(proc.url + "/health").status_code == 200
    finally:
        proc.stop()


def test_grammars_and_forced_tool_calls_hold_with_an_image(server: ServerProcess) -> None:
    """A JSON schema and a forced tool call constrain a reply to an image prompt as they do a text one: the reply
    parses and matches the schema, and the forced call is made with arguments of its schema (chat and Messages)."""
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    uri = data_uri(IMG)
    chat = _oai(server).chat.completions.create(
        model="toy", messages=_messages(uri), max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "picture", "schema": schema}},
        extra_body={"chat_template_kwargs": NO_THINKING})
    reply = json.loads(chat.choices[0].message.content)
    assert reply["colour"] in ("red", "green", "blue") and isinstance(reply["count"], int)
    tool = {"type": "function", "function": {"name": "describe", "parameters": schema}}
    forced = _oai(server).chat.completions.create(
        model="toy", messages=_messages(uri), max_tokens=64, temperature=0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "describe"}},
        extra_body={"chat_template_kwargs": NO_THINKING})
    calls = forced.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "describe"
    args = json.loads(calls[0].function.arguments)
    assert args["colour"] in ("red", "green", "blue") and isinstance(args["count"], int)
    msg = _ant(server).messages.create(
        model="toy", max_tokens=64, messages=_ant_messages(_ant_base64(IMG)),
        tools=[{"name": "describe", "input_schema": schema}], tool_choice={"type": "tool", "name": "describe"},
        extra_body={"temperature": 0})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and uses[0].name == "describe" and uses[0].input["colour"] in ("red", "green", "blue")
