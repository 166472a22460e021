"""``tandem generate``: the JSON object, in-process and as ``python -m tandem``; bad input exits with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.engine import Engine
from tandem.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--prompt-ids", "1,2,3", "--max-tokens", "5", "--json"]


def _check(obj: dict[str, object], tiny_ckpt: Path) -> None:
    assert set(obj) >= {"prompt_ids", "output_ids", "text", "finish_reason", "timing"}
    assert obj["prompt_ids"] == [1, 2, 3]
    done = Engine.from_pretrained(tiny_ckpt).complete([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))
    assert obj["output_ids"] == done.token_ids and obj["finish_reason"] == done.finish_reason
    assert obj["text"] == "" and obj["model"] == tiny_ckpt.name
    timing = obj["timing"]
    assert isinstance(timing, dict) and set(timing) == {"load_s", "prefill_s", "decode_s", "decode_tokens_per_s"}
    assert all(timing[k] >= 0 for k in ("load_s", "prefill_s", "decode_s"))


def test_generate_json_in_process(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_ckpt), *ARGS]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    _check(json.loads(out), tiny_ckpt)


def test_generate_json_subprocess(tiny_ckpt: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem", "generate", str(tiny_ckpt), *ARGS, "--device", "cpu"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _check(json.loads(proc.stdout), tiny_ckpt)


def test_generate_streams_text(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_ckpt), "--prompt-ids", "4,5", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out == "\n"  # no tokenizer: ids decode to no text


@pytest.mark.parametrize("ids", ["1,x,3", "1.5"])
def test_bad_prompt_ids(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str], ids: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", str(tiny_ckpt), "--prompt-ids", ids])
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--prompt-ids takes comma-separated integers" in errors[0]


def test_out_of_vocabulary_prompt_ids(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_ckpt), "--prompt-ids", "1,512"]) == 2
    err = capsys.readouterr().err
    assert err == "tandem: error: prompt token id 512 is outside the vocabulary (0..511)\n"


def test_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_model"
    assert main(["generate", str(missing), "--prompt-ids", "1,2"]) == 2
    assert capsys.readouterr().err == f"tandem: error: {missing}: not a checkpoint directory\n"


def test_missing_model_dir_subprocess(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem", "generate", str(tmp_path / "nope"), "--prompt-ids", "1"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("tandem: error: ")


def test_cuda_device_refused(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU (forced here, so the test means the same on a GPU machine) --device cuda is a clear error."""
    from tandem.backend.cuda import loader

    monkeypatch.setattr(loader, "gpu_available", lambda: False)
    assert main(["generate", str(tiny_ckpt), "--prompt-ids", "1", "--device", "cuda"]) == 2
    assert "tandem: error: --device cuda" in capsys.readouterr().err


def test_serve_on_a_busy_port_is_a_clear_error(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A port already in use: one error line and exit 2, before any model is loaded."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", str(tiny_ckpt), "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"tandem: error: cannot listen on 127.0.0.1:{port}" in err and "loading" not in err


@pytest.mark.parametrize("where", ["a_file", "under_a_file", "read_only"])
def test_unusable_cache_dir_is_one_line(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """--cache-dir naming a file, a path under a file, or a folder that takes no new file: one error line and
    exit 2 before any request (the read-only folder is simulated: root may write anywhere)."""
    from tandem.cache import disk

    a_file = tmp_path / "f"
    a_file.write_text("x")
    path = {"a_file": a_file, "under_a_file": a_file / "sub", "read_only": tmp_path / "ro"}[where]
    if where == "read_only":
        path.mkdir()

        def refuse(*args: object, **kwargs: object) -> None:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(disk.tempfile, "mkstemp", refuse)
    assert main(["generate", str(tiny_ckpt), *ARGS, "--cache-dir", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tandem: error: --cache-dir {path}: "), err


@pytest.mark.parametrize("option", [["--prefix-chunk", "0"], ["--cache-gb", "nan"], ["--cache-gb", "inf"],
                                    ["--cache-disk-gb", "nan"], ["--cache-host-gb", "-1"]])
def test_bad_cache_options_are_one_line(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str],
                                        option: list[str]) -> None:
    assert main(["generate", str(tiny_ckpt), *ARGS, "--cache", "on", *option]) == 2
    err = capsys.readouterr().err
    want = "prefix_chunk must be a positive multiple of 64" if option[0] == "--prefix-chunk" else \
        "cache sizes must be"
    assert err.count("\n") == 1 and err.startswith("tandem: error: ") and want in err, err


def test_package_root_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``tandem.Engine`` / ``tandem.SamplingParams`` are the engine's classes; ``tandem --version`` prints it."""
    import tandem
    from tandem.sampling import SamplingParams

    assert tandem.Engine is Engine and tandem.SamplingParams is SamplingParams
    with pytest.raises(AttributeError):
        tandem.no_such_name  # noqa: B018
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"tandem {tandem.__version__}"
