"""Server test helpers: a tiny random model with a trained tokenizer, a real `tandem serve` subprocess, and the
session's keyed server of the embedded model.

Random weights write random text; the protocol does not care, and grammar masks force valid structure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tools.make_checkpoint import write_checkpoint
from tools.make_tokenizer import train_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = REPO_ROOT / "tandem" / "assets" / "default"
API_KEY = "sk-tandem-test"  # the key of `keyed_server`
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # a server's BLAS env
_WORDS = ("the of and to in is was for on that with as by at from it an be this are or which has have not but "
          "tool call function parameter value city weather json name arguments true false null number string "
          "object array Paris London 12 3.5 café naïve 東京").split()


def make_model(path: Path, seed: int = 0) -> Path:
    """Tokenizer (byte-level BPE, Qwen specials, the Qwen3.5-style template) + a random checkpoint of its size."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(_WORDS) for _ in range(60)) + ' {"a": [1, 2], "b": "x"}\n<parameter=city>\n'
             for _ in range(400)]
    train_tokenizer(texts, 512, path)
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    write_checkpoint(path, vocab_size=len(vocab), num_shards=1, with_vision=False, seed=seed)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


class ServerProcess:
    """`python -m tandem serve MODEL --port 0 ...` on loopback (or ``command`` in its place, a server that prints
    the same "serving ... at URL" line); `url` is the base URL (…/v1 stripped). No usage ledger unless ``args``
    name one (``--ledger PATH``)."""

    def __init__(self, model: Path, *args: str, ready_timeout_s: float = 60.0,
                 env: dict[str, str] | None = None, command: list[str] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(env or {})}
        argv = command if command is not None else [sys.executable, "-m", "tandem", "serve", str(model)]
        if command is None and "--ledger" not in args:  # tests keep no ledger in the home folder
            args = (*args, "--ledger", "off")
        self.proc = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
        self.lines: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if " at http://" in line and not self.url:
                    self.url = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
                    ready.set()

        self.errors: list[str] = []
        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=lambda: self.errors.extend(self.proc.stderr or []), daemon=True).start()
        if not ready.wait(ready_timeout_s):
            self.stop()
            raise RuntimeError(f"server did not start: {''.join(self.lines)}{''.join(self.errors)}")
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server never became healthy")

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One HTTP request with a bounded timeout."""
        kwargs.setdefault("timeout", 60)
        return httpx.request(method, self.url + path, **kwargs)

    def logged(self, *parts: str, timeout_s: float = 5.0) -> bool:
        """True once a stderr line holds every part (the reader thread may lag the response)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(all(p in line for p in parts) for line in self.errors):
                return True
            time.sleep(0.05)
        return False

    def terminate(self) -> None:
        """Send SIGTERM (drain) without waiting."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status."""
        self.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


@pytest.fixture(scope="session")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make_model`'s tiny random model (seed 0), written once for the session (conftest.py registers it); the
    tests read it and never write into it."""
    return make_model(tmp_path_factory.mktemp("served_model"))


@pytest.fixture(scope="session")
def keyed_server() -> Iterator[ServerProcess]:
    """The embedded model served with API_KEY and a 2,048-token context, one process for the session (conftest.py
    registers it): the official-client tests of the Anthropic API and of the agents' request shapes share it."""
    proc = ServerProcess(EMBEDDED, "--max-context", "2048", "--api-key", API_KEY)
    try:
        yield proc
    finally:
        proc.stop()
