"""The prefix cache through the server: cached_tokens in usage (whole and streamed), cache_salt, GET/DELETE
/v1/cache, the Prometheus series; a real `tandem serve` process on loopback with the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from server_fixtures import ServerProcess


@pytest.fixture(scope="module")
def model_dir(served_model: Path) -> Path:
    return served_model


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    # --spec off: the entry counts below are the plain loop's; speculating (serve's default on the CPU), where a
    # request's state ends depends on StairCut's rounds, which follow measured times (6 entries once instead of 5)
    proc = ServerProcess(model_dir, "--max-context", "1024", "--prefix-chunk", "64", "--device", "cpu",
                         "--served-model-name", "m", "--spec", "off")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


PROMPT = [(7 * i + 3) % 300 + 5 for i in range(200)]


def complete(client: OpenAI, **kw: object) -> tuple[str, list[float], int]:
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  **kw)  # type: ignore[call-overload]
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    lp = r.choices[0].logprobs
    return r.choices[0].text, list(lp.token_logprobs if lp is not None else []), \
        int(r.usage.prompt_tokens_details.cached_tokens or 0)


def test_cached_tokens_and_identical_output(server: ServerProcess, client: OpenAI) -> None:
    server.request("DELETE", "/v1/cache")
    text, lps, cached = complete(client)
    assert cached == 0
    assert complete(client) == (text, lps, 200)  # the prompt's end [192, 200): nothing prefilled
    body = server.request("GET", "/v1/cache").json()
    # three grid blocks, the prompt's end and the session block [192, 207) (a resent prompt stops before its end)
    assert body["enabled"] and body["tiers"]["resident"]["entries"] == 5 and body["hits"] >= 1
    assert body["reused_tokens"] >= 200
    stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage and usage[-1].prompt_tokens_details is not None
    assert usage[-1].prompt_tokens_details.cached_tokens == 200


def test_chat_reports_cached_tokens(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "the of and to in is was for on " * 30},
                {"role": "user", "content": "weather in Paris"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                           temperature=0)
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                           temperature=0)
    assert first.usage is not None and again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens  # the prompt's end
    assert first.choices[0].message.content == again.choices[0].message.content


def test_anthropic_stream_reports_cached_tokens(server: ServerProcess) -> None:
    """The Messages API's streamed usage (the SDK's final message) says what the whole answer says: the prompt
    tokens read from the cache and the rest as input_tokens."""
    import anthropic

    an = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=60, max_retries=0)
    kw: dict[str, object] = {"model": "m", "system": "the of and to in is was for on " * 30, "max_tokens": 4,
                             "messages": [{"role": "user", "content": "weather in Paris"}],
                             "extra_body": {"temperature": 0}}
    an.messages.create(**kw)  # type: ignore[call-overload]
    whole = an.messages.create(**kw)  # type: ignore[call-overload]
    with an.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert whole.usage.cache_read_input_tokens and whole.usage.cache_read_input_tokens >= 64
    assert (streamed.usage.input_tokens, streamed.usage.cache_read_input_tokens) == \
        (whole.usage.input_tokens, whole.usage.cache_read_input_tokens)


def test_cache_salt_separates_and_is_validated(server: ServerProcess, client: OpenAI) -> None:
    complete(client)
    assert complete(client, extra_body={"cache_salt": "tenant-a"})[2] == 0
    assert complete(client, extra_body={"cache_salt": "tenant-a"})[2] == 200
    for bad in ("", 5):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            complete(client, extra_body={"cache_salt": bad})


def test_delete_and_metrics(server: ServerProcess, client: OpenAI) -> None:
    complete(client)
    complete(client)
    metrics = server.request("GET", "/metrics").text
    for series in ("tandem_cache_hits_total", "tandem_cache_misses_total", "tandem_cache_reused_tokens_total",
                   "tandem_cache_prefilled_tokens_total", 'tandem_cache_bytes{tier="resident"}',
                   'tandem_cache_evictions_total{tier="disk"}'):
        assert series in metrics, series
    deleted = server.request("DELETE", "/v1/cache").json()["deleted"]
    assert deleted >= 3
    assert server.request("GET", "/v1/cache").json()["tiers"]["resident"]["entries"] == 0
    assert complete(client)[2] == 0


def test_cache_off(model_dir: Path) -> None:
    proc = ServerProcess(model_dir, "--cache", "off", "--device", "cpu", "--served-model-name", "m")
    try:
        assert proc.request("GET", "/v1/cache").json() == {"object": "cache", "enabled": False}
        c = OpenAI(base_url=proc.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        assert complete(c)[2] == 0 and complete(c)[2] == 0
    finally:
        proc.stop()


def test_cache_salt_on_the_messages_and_responses_apis(server: ServerProcess, client: OpenAI) -> None:
    """``cache_salt`` (extra_body) keeps the Messages and Responses APIs' requests apart as it does on chat, and a
    bad one is the same clear 400."""
    import anthropic

    system = "the of and to in is was for on " * 30
    an = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=60, max_retries=0)

    def message(salt: object) -> int:
        r = an.messages.create(model="m", system=system, max_tokens=4, extra_body={"temperature": 0, "cache_salt": salt},
                               messages=[{"role": "user", "content": "weather in Rome"}])
        return int(r.usage.cache_read_input_tokens or 0)

    def response(salt: object) -> int:
        r = client.responses.create(model="m", instructions=system, input="weather in Oslo", max_output_tokens=16,
                                    temperature=0, extra_body={"cache_salt": salt})
        assert r.usage is not None
        return int(r.usage.input_tokens_details.cached_tokens or 0)

    for ask in (message, response):  # the two share a salt's entries (the same system prompt): a salt each
        salt = f"tenant-{ask.__name__}"
        assert ask(salt) == 0, ask.__name__  # a salt of its own: nothing of the unsalted requests
        assert ask(salt) >= 64, ask.__name__
        assert ask(salt + "-other") == 0, ask.__name__
    with pytest.raises(anthropic.BadRequestError, match="cache_salt"):
        message("")
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        response(5)
