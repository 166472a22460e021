"""The made-up architecture (tests/toy_arch.py), registered through the registry's plug-in call and nothing else,
serves requests through the real HTTP server (``tandem.server.serve.serve``: Hypercorn on loopback, in a
subprocess) with speculation on (``spec="lookup"``): the completions equal a plain in-process generation, token
for token, and the server's rounds commit more than one token on average (guesses were verified and accepted).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.engine import Engine
from tandem.models import registry
from tandem.sampling import SamplingParams
from tools.make_tokenizer import train_tokenizer

REPO = Path(__file__).resolve().parents[1]
TOY = "tests.toy_arch:ToyModel"
STEP = 3
# the real `tandem serve` entry point, after the one call a plug-in makes: registering its architecture
LAUNCH = ("import sys\n"
          "from tandem.models import registry\n"
          f"registry.register(['ToyForCausalLM'], {TOY!r})\n"
          "from tandem.server.serve import serve\n"
          "sys.exit(serve(sys.argv[1], host='127.0.0.1', port=0, device='cpu', spec='lookup', max_context=512))\n")


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A toy checkpoint with a trained tokenizer (so text goes in and out); V = the tokenizer's size."""
    path = tmp_path_factory.mktemp("toy_server")
    train_tokenizer([f"count {i} then {i + STEP} and {i + 2 * STEP} " * 4 for i in range(300)], 400, path)
    vocab = json.loads((path / "tokenizer.json").read_text())
    size = len(vocab["model"]["vocab"]) + len(vocab["added_tokens"])
    cfg = {"architectures": ["ToyForCausalLM"], "model_type": "toy", "vocab_size": size,
           "max_position_embeddings": 512, "eos_token_ids": []}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "toy_weights.json").write_text(json.dumps({"step": STEP}))
    return path


@pytest.fixture(scope="module")
def server(toy_dir: Path) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(toy_dir)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    found = threading.Event()
    url: list[str] = []
    errors: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r" at (http://127\.0\.0\.1:\d+)/v1", line)
            if m and not url:
                url.append(m.group(1))
                found.set()

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=lambda: errors.extend(proc.stderr or []), daemon=True).start()
    try:
        if not found.wait(60):
            raise RuntimeError("the toy server did not start: " + "".join(errors))
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _plain(toy_dir: Path, prompt: list[int], max_tokens: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], str]:
    monkeypatch.setattr(registry, "_ADAPTERS", dict(registry._ADAPTERS))
    registry.register(["ToyForCausalLM"], TOY)
    engine = Engine.from_pretrained(toy_dir, spec="off")
    done = engine.complete(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return done.token_ids, done.text


def _rounds(base: str) -> tuple[float, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    total = float(re.search(r"^tandem_tokens_per_round_sum (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    count = float(re.search(r"^tandem_tokens_per_round_count (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    return total, count


def test_the_toy_speculates_through_the_http_server(server: str, toy_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [5 + STEP * i for i in range(24)] + [5, 5 + STEP]  # the continuation is in the prompt: lookup finds it
    want_ids, want_text = _plain(toy_dir, prompt, 40, monkeypatch)
    assert want_ids == [5 + STEP * (2 + i) for i in range(40)]  # (t + step) mod V, V > 200
    before = _rounds(server)
    r = httpx.post(server + "/v1/completions", json={"model": toy_dir.name, "prompt": prompt, "max_tokens": 40,
                                                      "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert want_text and body["choices"][0]["text"] == want_text and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 40 and body["usage"]["prompt_tokens"] == len(prompt)
    after = _rounds(server)
    tokens, rounds = after[0] - before[0], after[1] - before[1]
    assert tokens == 40 and 0 < rounds < 40  # some rounds committed several tokens: guesses were accepted


def test_the_toy_streams_the_same_text(server: str, toy_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [7 + STEP * i for i in range(10)] + [7]
    _, want_text = _plain(toy_dir, prompt, 20, monkeypatch)
    parts: list[str] = []
    with httpx.stream("POST", server + "/v1/completions", json={"model": toy_dir.name, "prompt": prompt,
                                                                 "max_tokens": 20, "temperature": 0,
                                                                 "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(parts) == want_text and want_text


def test_a_bad_request_is_refused_and_the_server_keeps_serving(server: str, toy_dir: Path) -> None:
    r = httpx.post(server + "/v1/completions", json={"model": toy_dir.name, "prompt": [10 ** 6], "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 400, r.text
    ok = httpx.post(server + "/v1/completions", json={"model": toy_dir.name, "prompt": [1, 4], "max_tokens": 3,
                                                       "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
