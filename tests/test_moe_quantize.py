"""`tandem quantize --targets experts` on the MoE members: routed and shared experts quantised (fused experts
written per expert), router and shared-expert gate kept, the result loads and decodes; calibration records the
experts' inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tandem.checkpoint import Checkpoint
from tandem.cli import main
from tandem.engine import Engine
from tandem.formats import DenseLinear, FP8BlockLinear, NVFP4Linear, load_linear
from tandem.models.qwen3_5_moe.moe import SparseMoE
from tandem.models.qwen3_5_moe.weights import MoELayerWeights
from tandem.quant import activation_mean_squares, quantize_checkpoint
from tandem.sampling import SamplingParams
from tools.make_moe_checkpoint import fuse_experts, write_moe_checkpoint

IDS = [5, 17, 3, 99, 256, 7, 7, 42, 511, 0, 13, 8] * 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _logits(path: Path) -> np.ndarray:
    m = Engine.from_pretrained(path).model
    out: np.ndarray = m.prefill(m.new_state(len(IDS)), IDS, all_logits=True)
    return out


@pytest.mark.parametrize("arch, experts, fmt", [("qwen3_5_moe", "fused", "nvfp4"), ("qwen3_5_moe", "per_expert", "fp8"),
                                                ("qwen3_next", "fused", "fp8"), ("qwen3_next", "per_expert", "nvfp4")])
def test_experts_target(tmp_path: Path, arch: str, experts: str, fmt: str) -> None:
    src = write_moe_checkpoint(tmp_path / "src", arch=arch, experts=experts, num_experts=5,
                               mlp_only_layers=(1,) if arch == "qwen3_next" else ())
    rep = quantize_checkpoint(src, tmp_path / "q", fmt, targets=["experts"], keep=["*.layers.2.mlp.experts.4.*"])
    ck = Checkpoint.open(tmp_path / "q")
    pre = "model.language_model.layers." if arch == "qwen3_5_moe" else "model.layers."
    kind = NVFP4Linear if fmt == "nvfp4" else FP8BlockLinear
    sparse = [0, 2, 3] if arch == "qwen3_next" else [0, 1, 2, 3]
    for i in sparse:
        p = f"{pre}{i}.mlp."
        assert not ck.has(p + "experts.gate_up_proj") and not ck.has(p + "experts.down_proj")
        for e in range(5):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                lin = load_linear(ck, f"{p}experts.{e}.{proj}")
                assert type(lin) is (DenseLinear if (i, e) == (2, 4) else kind)
        assert isinstance(load_linear(ck, p + "shared_expert.up_proj"), kind)
        assert type(load_linear(ck, p + "gate")) is DenseLinear
        assert type(load_linear(ck, p + "shared_expert_gate")) is DenseLinear
    if arch == "qwen3_next":
        assert type(load_linear(ck, f"{pre}1.mlp.up_proj")) is DenseLinear  # a dense layer's MLP: the mlp target
    assert ck.has("mtp.fc.weight") and type(load_linear(ck, f"{pre}0.linear_attn.out_proj")) is DenseLinear
    assert len(rep.quantized) == len(sparse) * (5 * 3 + 3) - 3
    assert rep.bytes_after < rep.bytes_before
    a, b = _logits(src), _logits(tmp_path / "q")
    assert (a.argmax(1) == b.argmax(1)).mean() > 0.7 and np.abs(a - b).max() < 0.5 * np.abs(a).max()
    out = Engine.from_pretrained(tmp_path / "q").complete(IDS, GREEDY)
    assert len(out.token_ids) == 16


def test_fused_and_per_expert_sources_quantise_alike(tmp_path: Path) -> None:
    per = write_moe_checkpoint(tmp_path / "per", experts="per_expert")
    fused = fuse_experts(per, tmp_path / "fused")
    quantize_checkpoint(per, tmp_path / "qa", "nvfp4", targets=["experts"])
    quantize_checkpoint(fused, tmp_path / "qb", "nvfp4", targets=["experts"])
    qa, qb = Checkpoint.open(tmp_path / "qa"), Checkpoint.open(tmp_path / "qb")
    assert qa.text_names() == qb.text_names()  # mtp.* is never quantised: it keeps each source's layout
    for name in qa.text_names():
        assert qa.dtype(name) == qb.dtype(name) and np.array_equal(qa.raw(name), qb.raw(name)), name
    np.testing.assert_array_equal(_logits(tmp_path / "qa"), _logits(tmp_path / "qb"))


def test_calibrated_experts(tmp_path: Path) -> None:
    src = write_moe_checkpoint(tmp_path / "src")
    model = Engine.from_pretrained(src).model
    act = activation_mean_squares(model, list(range(1, 200)))
    p = "model.language_model.layers.0.mlp."
    assert p + "gate" in act and p + "shared_expert.down_proj" in act
    assert any(k.startswith(p + "experts.") for k in act)
    ffn = model.weights.layers[0]
    assert isinstance(ffn, MoELayerWeights) and isinstance(ffn.ffn, SparseMoE)
    assert type(ffn.ffn.experts[0].gate) is DenseLinear  # the recording proxies are removed afterwards
    rep = quantize_checkpoint(src, tmp_path / "q", "nvfp4", targets=["experts"], act=act)
    assert rep.calibrated and rep.quantized
    Engine.from_pretrained(tmp_path / "q").complete(IDS, GREEDY)


def test_cli_targets_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_moe_checkpoint(tmp_path / "src", arch="qwen3_next")
    assert main(["quantize", str(src), str(tmp_path / "q"), "--format", "fp8", "--targets", "experts,attn"]) == 0
    assert "quantised" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "fp8" and "model.layers.0.mlp.gate" in cfg["modules_to_not_convert"]
    assert isinstance(load_linear(Checkpoint.open(tmp_path / "q"), "model.layers.3.self_attn.q_proj"), FP8BlockLinear)
    Engine.from_pretrained(tmp_path / "q").complete(IDS, GREEDY)
