"""`tandem serve` reads images through the official `openai` client (chat ``image_url`` parts with data URIs): the same
greedy tokens as the engine in-process; a bad image, an http(s) URL and an image sent to a model without a vision
tower are 400s naming the messages, and the server keeps serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server_fixtures import REPO_ROOT, ServerProcess
from tandem.engine import Engine
from tandem.sampling import SamplingParams

pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
openai = pytest.importorskip("openai")
from hf_reference import write_hf_vl_checkpoint  # noqa: E402


def _png(w: int, h: int, seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_vl_checkpoint(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def server(vl_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(vl_model, "--max-context", "1024", "--vision", "on", "--served-model-name", "toy")
    try:
        yield proc
    finally:
        proc.stop()


def _messages(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "this picture?"}]}]


def test_openai_client_image_request(server: ServerProcess, vl_model: Path) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = _messages(_png(60, 44, 1))
    got = client.chat.completions.create(model="toy", messages=messages, max_tokens=16, temperature=0,  # type: ignore[arg-type]
                                         logprobs=True, extra_body={"ignore_eos": True})
    engine = Engine.from_pretrained(vl_model, max_context=1024, cache="off")
    want = engine.complete(messages, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    ids, _ = engine.encode_prompt_images(messages)
    assert got.usage is not None and got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 16
    assert got.choices[0].logprobs is not None and got.choices[0].logprobs.content is not None
    assert [e.token for e in got.choices[0].logprobs.content] == \
        [engine.tokenizer.decode([t]) for t in want.token_ids]  # type: ignore[union-attr]


@pytest.mark.parametrize("url,match", [("data:image/png;base64,iVBORw0KGgo=", "image 0"),
                                       ("https://example.com/cat.png", "not fetched"),
                                       ("data:image/png;base64,%%%", "base64")])
def test_bad_images_are_400(server: ServerProcess, url: str, match: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model="toy", messages=_messages(url), max_tokens=4)  # type: ignore[arg-type]
    ok = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert ok.choices[0].finish_reason is not None


def test_model_without_vision_refuses_images() -> None:
    proc = ServerProcess(REPO_ROOT / "tandem" / "assets" / "default", "--max-context", "1024", "--served-model-name", "toy")
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none")
        with pytest.raises(openai.BadRequestError, match="reads no images"):
            client.chat.completions.create(model="toy", messages=_messages(_png(32, 32, 2)),  # type: ignore[arg-type]
                                           max_tokens=4)
    finally:
        proc.stop()
