"""Device choice and kernel packaging, on the CPU (runs in CI, where there is no GPU).

``--device auto`` is the CPU without a GPU, ``--device cuda`` there fails with a clear error (engine and CLI);
device logits take the host choice code unless the choice is a plain greedy one; the loader finds `cuda/` in a
checkout and the packaged copy otherwise, and setup.py's build_py puts every kernel source into the package.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem import engine as engine_mod
from tandem import choose as choose_mod
from tandem.backend.cuda import loader
from tandem.cli import main
from tandem.engine import Engine
from tandem.sampling import PenaltyState, SamplingParams

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "gpu_available", lambda: False)


def test_auto_is_cpu_without_a_gpu(no_gpu: None, tiny_ckpt: Path) -> None:
    assert engine_mod._resolve_device("auto") == "cpu"
    assert engine_mod._resolve_device("cpu") == "cpu"
    engine = Engine.from_pretrained(tiny_ckpt, device="auto")
    assert isinstance(engine.model.weights.embed, np.ndarray)  # the host model itself


def test_cuda_without_a_gpu_is_a_clear_error(no_gpu: None, tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match=r"--device cuda.*(CuPy|GPU).*--device cpu"):
        Engine.from_pretrained(tiny_ckpt, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        Engine.from_pretrained(tiny_ckpt, device="tpu")


def test_cli_cuda_without_a_gpu_exits_2(no_gpu: None, tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["generate", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--device", "cuda"])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: --device cuda") and "\n" == err[-1] and err.count("\n") == 1


def test_cli_auto_runs_on_the_cpu(no_gpu: None, tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json"]) == 0
    assert '"output_ids"' in capsys.readouterr().out


class _DeviceRow:
    """Stands in for a CuPy row: not a NumPy array, copied to the host by ``get()``."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def get(self) -> np.ndarray:
        return self.a.copy()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, top_k=5, min_p=0.1, seed=2),
    SamplingParams(temperature=0.0),
])
def test_device_logits_route(params: SamplingParams, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device logits without penalties or a mask are chosen on the device (``choose.device_choose``, the sampler keyed by
    (seed, position) as choose_token: stood in here by the host choice); with penalties the row is copied and the
    host chooses; logprobs copy the row. The same ids either way."""
    rng = np.random.default_rng(0)
    pen = PenaltyState.from_params(params, 300, [3, 4, 5])
    active = pen if pen.active else None
    calls: list[tuple[int, int]] = []

    def device_choose(row: _DeviceRow, p: SamplingParams, seed: int, position: int) -> int:
        calls.append((seed, position))
        return choose_mod.choose_token(row.get(), p, None, seed, position)

    monkeypatch.setattr(choose_mod, "device_choose", device_choose)
    for position in range(20):
        logits = (rng.standard_normal(300) * 3).astype(np.float32)
        want = choose_mod.constraint_choose(logits, None, params, active, 7, position)
        assert choose_mod.constraint_choose(_DeviceRow(logits), None, params, active, 7, position) == want
        assert choose_mod.logprob(_DeviceRow(logits), want, 3) == choose_mod.logprob(logits, want, 3)
    assert calls == ([] if active is not None else [(7, p) for p in range(20)])


def test_loader_prefers_the_checkout_then_the_package(tmp_path: Path) -> None:
    repo, packaged = tmp_path / "cuda", tmp_path / "src"
    packaged.mkdir()
    (packaged / "a.cu").write_text("// packaged\n")
    assert loader.find_cuda_dir(repo, packaged) == packaged  # no checkout (a wheel install)
    repo.mkdir()
    assert loader.find_cuda_dir(repo, packaged) == packaged  # an empty folder is not a checkout
    (repo / "a.cu").write_text("// repo\n")
    assert loader.find_cuda_dir(repo, packaged) == packaged  # no setup.py beside it: site-packages/cuda/ of
    (tmp_path / "setup.py").write_text("# checkout\n")      # another package, not our checkout
    assert loader.find_cuda_dir(repo, packaged) == repo
    with pytest.raises(FileNotFoundError, match="no CUDA kernel sources"):
        loader.find_cuda_dir(tmp_path / "x", tmp_path / "y")
    assert loader.CUDA_DIR == loader.REPO_CUDA_DIR  # this test runs from a checkout


def test_cuda_defines_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """TANDEM_CUDA_DEFINES (a measuring aid: bench/trace_step.py's TANDEM_TRACE) becomes -D options after the others;
    unset, the options are the engine's; a malformed item is a ValueError naming it."""
    monkeypatch.delenv("TANDEM_CUDA_DEFINES", raising=False)
    assert loader.extra_defines() == ()
    assert loader.nvrtc_options("gemv", "90") == loader.NVRTC_OPTIONS + ("--gpu-architecture=sm_90a",)
    assert loader.nvrtc_options("rms_norm", "90") == loader.NVRTC_OPTIONS
    monkeypatch.setenv("TANDEM_CUDA_DEFINES", "TANDEM_TRACE, GEMV_WLOAD=0")
    assert loader.extra_defines() == ("-DTANDEM_TRACE", "-DGEMV_WLOAD=0")
    assert loader.nvrtc_options("rms_norm", "80") == loader.NVRTC_OPTIONS + ("-DTANDEM_TRACE", "-DGEMV_WLOAD=0")
    monkeypatch.setenv("TANDEM_CUDA_DEFINES", "OK 1BAD")
    with pytest.raises(ValueError, match="1BAD"):
        loader.extra_defines()
    monkeypatch.setenv("TANDEM_CUDA_DEFINES", "X=$(rm)")
    with pytest.raises(ValueError, match="not NAME"):
        loader.extra_defines()


def test_build_ships_the_kernel_sources(tmp_path: Path) -> None:
    out = tmp_path / "lib"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)], cwd=REPO, check=True,
                   capture_output=True)
    shipped = out / "tandem" / "backend" / "cuda" / "src"
    want = sorted(p.name for p in (REPO / "cuda").iterdir() if p.suffix in (".cu", ".cuh"))
    assert want and sorted(p.name for p in shipped.iterdir()) == want
    for name in want:
        assert (shipped / name).read_bytes() == (REPO / "cuda" / name).read_bytes()
    assert loader.find_cuda_dir(tmp_path / "no-checkout", shipped) == shipped
