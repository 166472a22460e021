"""Friendlier edges against real servers with the embedded model: the API key on every /v1 route, unknown fields
ignored with a warning (refused under --strict-fields), vLLM's request extras, the per-request log line, vLLM's
metric names, --reasoning-format content and --default-chat-template-kwargs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from server_fixtures import EMBEDDED, ServerProcess
from tandem.cli import build_parser

KEY = "sk-edge"
MSG = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(EMBEDDED, "--max-context", "2048", "--api-key", KEY, "--served-model-name", "toy")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def strict() -> Iterator[ServerProcess]:
    proc = ServerProcess(EMBEDDED, "--max-context", "2048", "--strict-fields", "--reasoning-format", "content",
                         "--reasoning-budget", "4", "--log-prompts", "--seed", "41")
    try:
        yield proc
    finally:
        proc.stop()


def _chat(server: ServerProcess, body: dict[str, object], key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return server.request("POST", "/v1/chat/completions", json={"messages": MSG, **body}, headers=headers)


def test_api_key(server: ServerProcess) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"):
        r = server.request("POST" if path != "/v1/models" else "GET", path, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert _chat(server, {"max_tokens": 2}, key="nearly" + KEY).status_code == 401
    assert _chat(server, {"max_tokens": 2}).status_code == 200
    r = server.request("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"x-api-key": KEY})
    assert r.status_code == 200
    assert server.request("GET", "/health").status_code == 200
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    assert OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).models.list().data[0].id == "toy"


def test_unknown_fields_warn_then_strict_refuses(server: ServerProcess, strict: ServerProcess) -> None:
    r = _chat(server, {"max_tokens": 2, "frobnicate": 1, "zz_future": {}})
    assert r.status_code == 200 and r.headers["x-tandem-ignored-fields"] == "frobnicate,zz_future"
    assert server.logged("WARNING", "ignored unknown fields: frobnicate")
    bad = _chat(strict, {"max_tokens": 2, "frobnicate": 1}, key=None)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "frobnicate"
    assert bad.json()["error"]["message"] == "unknown field 'frobnicate'"
    m = strict.request("POST", "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": MSG, "zz": 1})
    assert m.status_code == 400 and m.json()["type"] == "error"
    assert _chat(strict, {"max_tokens": -1}, key=None).status_code == 400  # bad input is still a 400


def test_vllm_extras(server: ServerProcess) -> None:
    nothink = {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 40, "temperature": 0}
    r = _chat(server, {**nothink, "guided_choice": ["yes", "no"]}).json()
    assert r["choices"][0]["message"]["content"] in ("yes", "no")
    r = _chat(server, {**nothink, "guided_regex": "[0-9]{3}-[a-z]{2}"}).json()
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r["choices"][0]["message"]["content"])
    r = _chat(server, {**nothink, "structured_outputs": {"json": {"type": "object", "properties": {
        "k": {"type": "boolean"}}, "required": ["k"], "additionalProperties": False}}}).json()
    assert r["choices"][0]["message"]["content"] in ('{"k": true}', '{"k": false}')
    r = server.request("POST", "/v1/completions", headers={"x-api-key": KEY},
                       json={"prompt": "x", "max_tokens": 12, "min_tokens": 12, "skip_special_tokens": True}).json()
    assert r["usage"]["completion_tokens"] == 12
    cont = _chat(server, {**nothink, "max_tokens": 4, "continue_final_message": True, "add_generation_prompt": False,
                          "messages": [*MSG, {"role": "assistant", "content": "    return"}]})
    assert cont.status_code == 200, cont.text


def test_thinking_token_budget(server: ServerProcess) -> None:
    for n in (0, 5):
        r = _chat(server, {"max_tokens": n + 6, "temperature": 0, "thinking_token_budget": n, "logprobs": True,
                           "ignore_eos": True}).json()
        tokens = [t["token"] for t in r["choices"][0]["logprobs"]["content"]]
        assert "</think>" not in tokens[:n] and tokens[n] == "</think>", tokens


def test_log_line_and_metrics(server: ServerProcess) -> None:
    _chat(server, {"max_tokens": 3, "messages": [{"role": "user", "content": "secret-words-here"}]})
    assert server.logged("chat 200 prompt=")
    lines = [line for line in server.errors if "chat 200 prompt=" in line]
    assert lines and "completion=" in lines[-1] and "ttft=" in lines[-1] and "finish=" in lines[-1]
    assert not any("secret-words-here" in line for line in server.errors)
    text = server.request("GET", "/metrics").text
    for name in ("vllm:e2e_request_latency_seconds_bucket", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name + '{' in text and 'model_name="toy"' in text, name
    assert re.search(r'vllm:request_success_total\{finished_reason="(stop|length)",model_name="toy"\} [1-9]', text)
    drafts = re.search(r'vllm:spec_decode_num_draft_tokens_total\{model_name="toy"\} ([0-9.]+)', text)
    accepted = re.search(r'vllm:spec_decode_num_accepted_tokens_total\{model_name="toy"\} ([0-9.]+)', text)
    assert drafts and accepted and 0 <= float(accepted.group(1)) <= float(drafts.group(1))  # > 0 once rounds verify


def test_reasoning_in_content_and_budget(strict: ServerProcess) -> None:
    r = _chat(strict, {"max_tokens": 20, "temperature": 0}, key=None).json()["choices"][0]["message"]
    assert r["reasoning_content"] is None and r["content"].startswith("<think>\n") and "</think>" in r["content"]
    assert strict.logged("prompt_text=", "def add")  # --log-prompts


def test_server_seed_is_the_seed_of_a_request_that_names_none(strict: ServerProcess) -> None:
    """--seed 41: an unseeded sampled request repeats, and equals the same request naming seed 41 (its own seed
    wins where it names one)."""
    body = {"max_tokens": 24, "temperature": 1.0, "chat_template_kwargs": {"enable_thinking": False}}
    texts = []
    for extra in ({}, {}, {"seed": 41}):
        r = _chat(strict, {**body, **extra}, key=None)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] == texts[2] and texts[0]
    others = {_chat(strict, {**body, "seed": s}, key=None).json()["choices"][0]["message"]["content"]
              for s in (1, 2, 3)}
    assert others != {texts[0]}  # the requests' own seeds are used: three seeds give more than the server's text


def test_default_template_kwargs_and_chat_template_file(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("TEMPLATE-MARK " + (EMBEDDED / "chat_template.jinja").read_text())
    proc = ServerProcess(EMBEDDED, "--max-context", "1024", "--default-chat-template-kwargs",
                         '{"enable_thinking": false}', "--chat-template", str(template), "--log-prompts")
    try:
        r = proc.request("POST", "/v1/chat/completions", json={"messages": MSG, "max_tokens": 8}).json()
        msg = r["choices"][0]["message"]
        assert msg["reasoning_content"] is None and msg["content"]  # the first reply is not empty
        assert proc.logged("prompt_text='TEMPLATE-MARK")
    finally:
        proc.stop()


def test_serve_flags() -> None:
    args = build_parser().parse_args(["serve", "--max-model-len", "512"])
    assert args.max_context == 512 and args.api_key is None and args.reasoning_format == "separate"
    serve_help = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore
    serve_help = " ".join(serve_help.split())
    assert "(default: 8000)" in serve_help and "--strict-fields" in serve_help


def test_load_progress_lines_without_a_terminal(server: ServerProcess) -> None:
    assert server.logged("loading layers: 8/8 layer (100%)")  # stderr is a pipe here: throttled lines, no bar


def test_spec_decode_counters() -> None:
    from tandem.server.metrics import Metrics

    m = Metrics("x")
    m.observe_round(num_tokens=3, num_nodes=5, seconds_since_last=0.03)  # 4 guesses verified, 2 accepted + bonus
    m.observe_round(num_tokens=1, num_nodes=1, seconds_since_last=0.01)  # a plain round: no draft
    text = m.render().decode()
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="x"} 4.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="x"} 2.0' in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="x"} 1.0' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="x"} 4.0' in text
