"""Loading the MoE members: registry keys, layouts (fused == per expert, bit for bit), FP8 experts, made-up
expert counts, the devices declared ("cpu", "cuda"), and bad checkpoints that must fail at load with one clear line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.config import ConfigError, read_config
from tandem.engine import Engine
from tandem.formats import DenseLinear, FP8BlockLinear
from tandem.models.qwen3_5_moe.model import Qwen3_5MoeModel
from tandem.models.qwen3_5_moe.moe import SparseMoE, route
from tandem.models.qwen3_5_moe.weights import MoELayerWeights
from tandem.models.qwen3_next.model import Qwen3NextModel
from tandem.models.registry import resolve
from tandem.safetensors_io import Tensor, save_safetensors
from tandem.sampling import SamplingParams
from tools.make_checkpoint import dequantize_checkpoint
from tools.make_moe_checkpoint import fuse_experts, write_moe_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
IDS = [5, 17, 3, 99, 256, 7, 7, 42, 511, 0, 13, 8] * 3


def _logits(path: Path) -> np.ndarray:
    m = Engine.from_pretrained(path).model
    out: np.ndarray = m.prefill(m.new_state(len(IDS)), IDS, all_logits=True)
    return out


def _sparse(model: Any) -> list[SparseMoE]:
    return [lw.ffn for lw in model.weights.layers if isinstance(lw, MoELayerWeights)
            and isinstance(lw.ffn, SparseMoE)]


@pytest.mark.parametrize("kw, cls", [
    (dict(), Qwen3_5MoeModel), (dict(layout="causal"), Qwen3_5MoeModel),
    (dict(arch="qwen3_next"), Qwen3NextModel)])
def test_registry_resolves(tmp_path: Path, kw: dict[str, Any], cls: type) -> None:
    path = write_moe_checkpoint(tmp_path / "c", **kw)
    assert resolve(read_config(path)) is cls
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = []  # the model_type alone is enough
    (path / "config.json").write_text(json.dumps(cfg))
    assert resolve(read_config(path)) is cls


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_fused_equals_per_expert(tmp_path: Path, arch: str) -> None:
    per = write_moe_checkpoint(tmp_path / "per", arch=arch, experts="per_expert", mlp_only_layers=(
        (2,) if arch == "qwen3_next" else ()))
    fused = fuse_experts(per, tmp_path / "fused")
    assert Checkpoint.open(fused).has(
        ("model.language_model." if arch == "qwen3_5_moe" else "model.") + "layers.0.mlp.experts.gate_up_proj")
    np.testing.assert_array_equal(_logits(per), _logits(fused))
    a, b = Engine.from_pretrained(per), Engine.from_pretrained(fused)
    assert a.complete(IDS, GREEDY).token_ids == b.complete(IDS, GREEDY).token_ids


def test_qwen3_next_layer_kinds(tmp_path: Path) -> None:
    """decoder_sparse_step 2 and mlp_only_layers [3]: only layer 1 is sparse (of 0..3); norm_topk_prob false."""
    path = write_moe_checkpoint(tmp_path / "n", arch="qwen3_next", decoder_sparse_step=2, mlp_only_layers=(3,),
                                norm_topk_prob=False)
    model = Engine.from_pretrained(path).model
    kinds = [type(lw.ffn).__name__ for lw in model.weights.layers]
    assert kinds == ["DenseFFN", "SparseMoE", "DenseFFN", "DenseFFN"]
    assert _sparse(model)[0].norm_topk_prob is False


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_fp8_experts_match_dequantized_twin(tmp_path: Path, arch: str) -> None:
    fp8 = write_moe_checkpoint(tmp_path / "fp8", arch=arch, experts="per_expert", fp8=True)
    twin = dequantize_checkpoint(fp8, tmp_path / "twin")
    m = Engine.from_pretrained(fp8).model
    ffn = _sparse(m)[0]
    assert isinstance(ffn.experts[0].gate, FP8BlockLinear) and isinstance(ffn.shared.down, FP8BlockLinear)
    assert type(ffn.router) is DenseLinear and type(ffn.shared_gate) is DenseLinear
    np.testing.assert_array_equal(_logits(fp8), _logits(twin))


@pytest.mark.parametrize("experts, top_k", [(7, 5), (5, 3), (5, 5), (1, 1), (3, 1)])
def test_made_up_expert_counts_load_and_decode(tmp_path: Path, experts: int, top_k: int) -> None:
    path = write_moe_checkpoint(tmp_path / "m", num_experts=experts, num_experts_per_tok=top_k,
                                moe_intermediate_size=24, experts="per_expert" if experts % 2 else "fused", seed=experts)
    engine = Engine.from_pretrained(path)
    out = engine.complete(IDS, GREEDY)
    assert len(out.token_ids) == 24 and all(0 <= t < engine.vocab_size for t in out.token_ids)
    ffn = _sparse(engine.model)[0]
    assert (len(ffn.experts), ffn.top_k) == (experts, top_k)
    x = np.random.default_rng(0).normal(0, 1, (40, engine.model.hp.hidden_size)).astype(np.float32)
    top, w = route(ffn.router.matmul(x), top_k, True)
    assert top.shape == (40, top_k) and all(len(set(r)) == top_k for r in top.tolist())
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
    if top_k == experts:
        assert set(ffn.experts_used(x, lambda lin, h: lin.matmul(h)).tolist()) == set(range(experts))


def test_route_ties_go_to_the_lower_index() -> None:
    logits = np.array([[0.0, 1.0, 1.0, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    top, w = route(logits, 2, True)
    assert top.tolist() == [[1, 2], [0, 1]]
    np.testing.assert_allclose(w, 0.5)
    top1, _ = route(logits[1:], 3, False)
    assert top1.tolist() == [[0, 1, 2]]  # one row alone: the same choice


def test_the_adapters_declare_the_gpu(tmp_path: Path) -> None:
    """Both MoE adapters offer "cuda" (tandem/models/qwen3_5_moe/cuda_model.py), so ``--device auto`` takes the GPU
    where one is found (tests/test_cuda_moe_engine.py); an unknown device is refused with one line."""
    model = Engine.from_pretrained(write_moe_checkpoint(tmp_path / "c")).model
    assert Qwen3_5MoeModel.capabilities.devices == Qwen3NextModel.capabilities.devices == ("cpu", "cuda")
    assert model.on_device("cpu") is model
    with pytest.raises(ValueError, match="unknown device"):
        model.on_device("tpu")


# ------------------------------------------------------------------------------------------- bad checkpoints
def _rewrite(path: Path, edit: Any) -> None:
    """Apply edit(tensors) to the single-file checkpoint at ``path``."""
    ck = Checkpoint.open(path)
    tensors: dict[str, Tensor] = {n: (ck.dtype(n), np.array(ck.raw(n))) for n in ck.names()}
    del ck
    edit(tensors)
    save_safetensors(path / "model.safetensors", tensors)


def _config(path: Path, **text: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (cfg.get("text_config", cfg)).update(text)
    (path / "config.json").write_text(json.dumps(cfg))


P = "model.language_model.layers.2.mlp."


def _drop_expert(t: dict[str, Tensor]) -> None:
    for s in ("gate", "up", "down"):
        del t[f"{P}experts.3.{s}_proj.weight"]


def _shrink_expert(t: dict[str, Tensor]) -> None:
    dtype, bits = t[f"{P}experts.1.up_proj.weight"]
    t[f"{P}experts.1.up_proj.weight"] = (dtype, np.ascontiguousarray(bits[:, :-1]))


def _shrink_fused(t: dict[str, Tensor]) -> None:
    dtype, bits = t[f"{P}experts.gate_up_proj"]
    t[f"{P}experts.gate_up_proj"] = (dtype, np.ascontiguousarray(bits[:, :-2]))


def _fused_u8(t: dict[str, Tensor]) -> None:
    _, bits = t[f"{P}experts.down_proj"]
    t[f"{P}experts.down_proj"] = ("U8", np.zeros(bits.shape, np.uint8))


def _drop_router(t: dict[str, Tensor]) -> None:
    del t[f"{P}gate.weight"]


@pytest.mark.parametrize("case, experts, edit, config, error, match", [
    ("missing expert", "per_expert", _drop_expert, {}, CheckpointError, r"experts\.3\.gate_proj\.weight' not found"),
    ("wrong expert shape", "per_expert", _shrink_expert, {}, CheckpointError,
     r"experts\.1\.up_proj: expected shape \[32, 64\], found \[32, 63\]"),
    ("wrong fused shape", "fused", _shrink_fused, {}, CheckpointError,
     r"experts\.gate_up_proj: expected shape \[5, 64, 64\], found \[5, 62, 64\]"),
    ("fused experts not float", "fused", _fused_u8, {}, CheckpointError, "fused experts must be BF16, F16 or F32"),
    ("missing router", "fused", _drop_router, {}, CheckpointError, r"mlp\.gate\.weight' not found"),
    ("top-k above expert count", "fused", None, {"num_experts_per_tok": 6}, ConfigError,
     r"'num_experts_per_tok' \(6\) exceeds num_experts \(5\)"),
    ("fewer experts than stored", "per_expert", None, {"num_experts": 4}, CheckpointError,
     r"experts\.4\.gate_proj: the checkpoint stores more experts than num_experts \(4\)"),
    ("more experts than stored", "fused", None, {"num_experts": 6}, CheckpointError,
     r"experts\.gate_up_proj: expected shape \[6, 64, 64\], found \[5, 64, 64\]"),
    ("no expert count", "fused", None, {"num_experts": None}, ConfigError, "'num_experts' is missing"),
])
def test_bad_moe_checkpoint_fails_at_load(tmp_path: Path, case: str, experts: str, edit: Any,
                                          config: dict[str, Any], error: type, match: str) -> None:
    path = write_moe_checkpoint(tmp_path / "bad", experts=experts)
    if edit is not None:
        _rewrite(path, edit)
    if config:
        _config(path, **config)
    with pytest.raises(error, match=match) as e:
        Engine.from_pretrained(path)
    assert "\n" not in str(e.value), f"{case}: the error is not one line"


@pytest.mark.parametrize("config, match", [
    ({"mlp_only_layers": [9]}, r"'mlp_only_layers' names layer 9, outside 0\.\.3"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be positive"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be bool"),
    ({"mlp_only_layers": [0], "intermediate_size": None}, "'intermediate_size' is missing"),
])
def test_bad_qwen3_next_config(tmp_path: Path, config: dict[str, Any], match: str) -> None:
    path = write_moe_checkpoint(tmp_path / "n", arch="qwen3_next")
    _config(path, **config)
    with pytest.raises(ConfigError, match=match) as e:
        Engine.from_pretrained(path)
    assert "\n" not in str(e.value)


def test_cli_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import main

    path = write_moe_checkpoint(tmp_path / "bad", experts="per_expert")
    _rewrite(path, _drop_expert)
    assert main(["generate", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "experts.3.gate_proj.weight" in err[0]


def test_cli_generates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import main

    path = write_moe_checkpoint(tmp_path / "ok", arch="qwen3_next")
    assert main(["generate", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "5", "--device", "cpu",
                 "--json", "--spec", "mtp"]) == 0
    out = json.loads(capsys.readouterr().out)
    plain = Engine.from_pretrained(path).complete([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))
    assert out["output_ids"] == plain.token_ids and out["stats"]["spec"] == "mtp"


def test_mtp_head_absent_and_malformed(tmp_path: Path) -> None:
    """No ``mtp.*``: no drafter, spec auto falls back to lookup. A malformed MTP expert fails with one line."""
    plain = write_moe_checkpoint(tmp_path / "nomtp", with_mtp=False)
    assert Engine.from_pretrained(plain).model.draft_heads() is None
    e = Engine.from_pretrained(plain, spec="auto")
    assert e.speculator is not None and [d.name for d in e.speculator.drafters] == ["lookup"]
    bad = write_moe_checkpoint(tmp_path / "bad", experts="per_expert")

    def edit(t: dict[str, Tensor]) -> None:
        del t["mtp.layers.0.mlp.experts.2.down_proj.weight"]

    _rewrite(bad, edit)
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.mlp\.experts\.2\.down_proj\.weight' not found") as err:
        Engine.from_pretrained(bad, spec="mtp")
    assert "\n" not in str(err.value)
