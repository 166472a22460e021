"""The CUDA backend's shape limits, checked at load (tandem/models/qwen3_5/cuda_limits.py), on the CPU (runs in CI).

Made-up configs: every shape the kernels serve passes (the 27B / 9B / default shapes, the GDN key head sizes 32 and
256); each dimension outside a kernel's limit is named in one line; the limits agree with the attention launcher's
own check; with a GPU present (faked), ``--device auto`` loads such a checkpoint on the CPU with one warning line
naming the field and ``--device cuda`` fails at load with one line naming it (engine and CLI), before any upload.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tandem.backend.cuda import attention_decode, loader
from tandem.cli import main
from tandem.engine import Engine
from tandem.models.protocol import DeviceLimitError
from tandem.models.qwen3_5 import cuda_limits
from tandem.models.qwen3_5.cuda_limits import cuda_limit
from tandem.models.qwen3_5.hparams import LINEAR, HParams
from tools.make_checkpoint import write_checkpoint

# the synthetic 27B shape of bench/decode.py
BASE = HParams(vocab_size=248320, hidden_size=5120, num_hidden_layers=4, intermediate_size=17408,
               num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
               linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25,
               max_position_embeddings=262144, layer_types=(LINEAR,) * 3 + ("full_attention",),
               tie_word_embeddings=False, attn_output_gate=True, eos_token_ids=())

SERVED = [
    {},  # 27B
    dict(hidden_size=4096, num_attention_heads=16, linear_num_value_heads=32),  # 9B
    dict(hidden_size=1024, head_dim=64, num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4,
         linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64),  # the embedded default
    dict(linear_key_head_dim=32), dict(linear_key_head_dim=256), dict(linear_key_head_dim=32, linear_value_head_dim=32),
    dict(linear_value_head_dim=1024), dict(linear_conv_kernel_dim=2), dict(linear_conv_kernel_dim=8),
    dict(head_dim=32), dict(head_dim=96, partial_rotary_factor=0.5), dict(num_attention_heads=32),  # group 8
    dict(hidden_size=5000, intermediate_size=1000, vocab_size=7),  # off the GEMV tiles: slower paths, no limit
]
REFUSED = [
    (dict(linear_key_head_dim=48), "linear_key_head_dim", "48"),
    (dict(linear_key_head_dim=16), "linear_key_head_dim", "16"),
    (dict(linear_key_head_dim=512), "linear_key_head_dim", "512"),
    (dict(linear_value_head_dim=16), "linear_value_head_dim", "16"),
    (dict(linear_value_head_dim=80), "linear_value_head_dim", "80"),
    (dict(linear_value_head_dim=2048), "linear_value_head_dim", "2048"),
    (dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim", "1"),
    (dict(linear_conv_kernel_dim=9), "linear_conv_kernel_dim", "9"),
    (dict(head_dim=48), "head_dim", "48"),
    (dict(head_dim=512), "head_dim", "512"),
    (dict(num_attention_heads=36), "num_attention_heads", "9 query heads a KV head"),
    (dict(hidden_size=16 * 8192 + 8), "hidden_size", str(16 * 8192 + 8)),
]


@pytest.mark.parametrize("change", SERVED)
def test_served_shapes_pass(change: dict[str, int]) -> None:
    assert cuda_limit(replace(BASE, **change)) is None


@pytest.mark.parametrize("change,field,value", REFUSED)
def test_each_limit_names_its_field(change: dict[str, int], field: str, value: str) -> None:
    msg = cuda_limit(replace(BASE, **change))
    assert msg is not None and "\n" not in msg, f"{change}: {msg!r}"
    assert f"'{field}'" in msg and value in msg, f"{change}: {msg!r} should name {field} and {value}"


@pytest.mark.parametrize("d", [16, 32, 48, 64, 96, 128, 160, 256, 288, 512])
@pytest.mark.parametrize("group", [1, 6, 8, 9, 16])
def test_attention_limits_match_the_launchers_check(d: int, group: int) -> None:
    """cuda_limit's head dim / group limits are exactly attention_decode's own (a NumPy-free launcher check)."""
    try:
        attention_decode._check_heads(4 * group, d, 4, None)
        launcher_ok = True
    except ValueError:
        launcher_ok = False
    ours = cuda_limit(replace(BASE, head_dim=d, num_attention_heads=4 * group, partial_rotary_factor=0.5))
    assert (ours is None) == launcher_ok, f"head_dim {d}, group {group}: cuda_limit {ours!r}, launcher {launcher_ok}"
    assert cuda_limits.MAX_GROUP == attention_decode.MAX_GROUP


@pytest.fixture()
def gpu_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU as far as device resolution can tell; no CUDA code runs (the checks come first)."""
    monkeypatch.setattr(loader, "gpu_available", lambda: True)


@pytest.fixture(scope="module")
def dk48(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with a GDN key head size (48) the CUDA scan has no kernel for (dv 32, head dim 32)."""
    return write_checkpoint(tmp_path_factory.mktemp("dk48"), linear_key_head_dim=48, linear_value_head_dim=32,
                            num_shards=1, with_vision=False, with_mtp=False)


def test_auto_falls_back_to_the_cpu_with_one_line(gpu_present: None, dk48: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tandem.engine"):
        engine = Engine.from_pretrained(dk48, device="auto", cache="off")
    assert isinstance(engine.model.weights.embed, np.ndarray)  # the host model itself
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.engine"]
    assert len(lines) == 1 and "'linear_key_head_dim' = 48" in lines[0] and "CPU" in lines[0], lines
    assert engine.complete([1, 2, 3]).token_ids


def test_cuda_fails_at_load_naming_the_field(gpu_present: None, dk48: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.models.qwen3_5.cuda_model as cuda_model

    def no_upload(*args: object) -> None:
        raise AssertionError("the check must come before any upload")

    monkeypatch.setattr(cuda_model, "CudaQwen3_5Model", no_upload)
    with pytest.raises(ValueError, match=r"^--device cuda: config field 'linear_key_head_dim' = 48: .*--device cpu"):
        Engine.from_pretrained(dk48, device="cuda", cache="off")
    with pytest.raises(DeviceLimitError, match="linear_key_head_dim"):
        Engine.from_pretrained(dk48, device="cpu", cache="off").model.on_device("cuda")


def test_cli_cuda_exits_2_with_one_line(gpu_present: None, dk48: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["generate", str(dk48), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--device", "cuda"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith("tandem: error: --device cuda: config field 'linear_key_head_dim' = 48"), err
