"""config.json reading and validation: every bad input names its field; bad checkpoints surface as clear errors.

Sources: tandem/config.py (reading, choice of adapter), tandem/models/qwen3_5/hparams.py (spec/qwen3_5.md §1.2,
§1.3), tandem/checkpoint.py (errors surfaced through Engine.from_pretrained and ``tandem generate``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.checkpoint import CheckpointError
from tandem.cli import main
from tandem.config import ConfigError, read_config
from tandem.engine import Engine
from tandem.models.qwen3_5.hparams import FULL, LINEAR, HParams
from tandem.models.registry import registered, resolve


@pytest.fixture(scope="module")
def base_config(tiny_ckpt: Path) -> dict[str, Any]:
    return json.loads((tiny_ckpt / "config.json").read_text())


def _write(tmp: Path, config: Any, raw_text: str | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(raw_text if raw_text is not None else json.dumps(config))
    return tmp


def _hp_error(tmp: Path, base: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> str:
    """Edit a copy of the text config, write it and return the ConfigError message of HParams.from_config."""
    cfg = json.loads(json.dumps(base))
    edit(cfg["text_config"])
    with pytest.raises(ConfigError) as e:
        HParams.from_config(read_config(_write(tmp, cfg)))
    return str(e.value)


# ------------------------------------------------------------------------------------------- reading config.json
def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json: not found"):
        read_config(tmp_path)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        read_config(tmp_path / "nope")


def test_invalid_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json: cannot read JSON"):
        read_config(_write(tmp_path, None, '{"architectures": ["Qwen3_5ForCausalLM"],'))


def test_top_level_not_object(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a JSON object"):
        read_config(_write(tmp_path, [1, 2]))


def test_text_config_not_object(tmp_path: Path, base_config: dict[str, Any]) -> None:
    cfg = dict(base_config, text_config=[1, 2, 3])
    with pytest.raises(ConfigError, match="text_config must be an object"):
        read_config(_write(tmp_path, cfg))


def test_architectures_not_strings(tmp_path: Path, base_config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="architectures must be a list of strings"):
        read_config(_write(tmp_path, dict(base_config, architectures="Qwen3_5ForCausalLM")))


def test_unknown_architecture_names_every_registered_key(tmp_path: Path, base_config: dict[str, Any]) -> None:
    cfg = dict(base_config, architectures=["LlamaForCausalLM"], model_type="llama")
    cfg["text_config"] = dict(cfg["text_config"], model_type="llama_text")
    with pytest.raises(ConfigError) as e:
        resolve(read_config(_write(tmp_path, cfg)))
    msg = str(e.value)
    assert "unsupported model" in msg and "LlamaForCausalLM, llama, llama_text" in msg
    keys = registered()
    assert {"Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "qwen3_5", "qwen3_5_text"} <= set(keys)
    for key in keys:
        assert key in msg


def test_resolve_falls_back_to_model_type(tmp_path: Path, base_config: dict[str, Any]) -> None:
    cfg = dict(base_config, architectures=["SomethingElse"], model_type="unknown")  # text model_type wins
    assert resolve(read_config(_write(tmp_path, cfg))).__name__ == "Qwen3_5Model"


# ------------------------------------------------------------------------------------------- hyper-parameters
def test_kv_heads_must_divide_heads(tmp_path: Path, base_config: dict[str, Any]) -> None:
    msg = _hp_error(tmp_path, base_config, lambda t: t.update(num_attention_heads=4, num_key_value_heads=3))
    assert "'num_key_value_heads' (3) must divide num_attention_heads (4)" in msg


def test_linear_key_heads_must_divide_value_heads(tmp_path: Path, base_config: dict[str, Any]) -> None:
    msg = _hp_error(tmp_path, base_config, lambda t: t.update(linear_num_key_heads=3, linear_num_value_heads=4))
    assert "'linear_num_key_heads' (3) must divide linear_num_value_heads (4)" in msg


def test_layer_types_wrong_length(tmp_path: Path, base_config: dict[str, Any]) -> None:
    msg = _hp_error(tmp_path, base_config, lambda t: t.update(layer_types=t["layer_types"][:-1]))
    assert "'layer_types' must list 4 layers" in msg


def test_layer_types_unknown_kind(tmp_path: Path, base_config: dict[str, Any]) -> None:
    def edit(t: dict[str, Any]) -> None:
        t["layer_types"][2] = "sliding_attention"
    msg = _hp_error(tmp_path, base_config, edit)
    assert "'layer_types[2]' is 'sliding_attention'" in msg


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size",
                                   "linear_conv_kernel_dim", "linear_key_head_dim"])
def test_negative_size_field(tmp_path: Path, base_config: dict[str, Any], field: str) -> None:
    msg = _hp_error(tmp_path, base_config, lambda t: t.update({field: -8}))
    assert f"config field {field!r} must be positive, got -8" in msg


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_attention_heads", "linear_value_head_dim"])
def test_missing_size_field(tmp_path: Path, base_config: dict[str, Any], field: str) -> None:
    msg = _hp_error(tmp_path, base_config, lambda t: t.pop(field))
    assert f"config field {field!r} is missing" in msg


def test_wrong_type_field(tmp_path: Path, base_config: dict[str, Any]) -> None:
    msg = _hp_error(tmp_path, base_config, lambda t: t.update(hidden_size="64"))
    assert "config field 'hidden_size' must be int" in msg


def test_odd_rotary_dim(tmp_path: Path, base_config: dict[str, Any]) -> None:
    def edit(t: dict[str, Any]) -> None:  # head_dim 32 × 0.28125 = 9 rotary channels
        t["partial_rotary_factor"] = 0.28125
        t["rope_parameters"]["partial_rotary_factor"] = 0.28125
    msg = _hp_error(tmp_path, base_config, edit)
    assert "'partial_rotary_factor' (0.28125) must give an even rotary dim" in msg


def test_eos_outside_vocabulary(tmp_path: Path, base_config: dict[str, Any]) -> None:
    msg = _hp_error(tmp_path, base_config, lambda t: t.update(eos_token_id=100000))
    assert "'eos_token_id' (100000) is outside the vocabulary" in msg


def test_nested_and_flat_configs_read_alike(tmp_path: Path, base_config: dict[str, Any]) -> None:
    nested = HParams.from_config(read_config(_write(tmp_path / "nested", base_config)))
    flat = dict(base_config["text_config"], architectures=["Qwen3_5ForCausalLM"],
                tie_word_embeddings=base_config["tie_word_embeddings"])
    raw = read_config(_write(tmp_path / "flat", flat))
    assert raw.text == raw.top and raw.architectures == ["Qwen3_5ForCausalLM"]
    assert HParams.from_config(raw) == nested
    assert nested.hidden_size == 64 and nested.vocab_size == 512 and nested.rotary_dim == 8
    assert nested.layer_types == (LINEAR, LINEAR, LINEAR, FULL)


def test_top_level_fields_carried_into_text_config(tmp_path: Path, base_config: dict[str, Any]) -> None:
    cfg = json.loads(json.dumps(base_config))
    cfg["text_config"].pop("tie_word_embeddings")
    cfg["tie_word_embeddings"] = True
    assert HParams.from_config(read_config(_write(tmp_path, cfg))).tie_word_embeddings is True


@pytest.mark.parametrize("interval,num_layers,expected_full", [(3, 7, [2, 5]), (4, 8, [3, 7]), (1, 3, [0, 1, 2]),
                                                               (None, 8, [3, 7])])
def test_layer_types_from_interval(tmp_path: Path, base_config: dict[str, Any], interval: int | None,
                                   num_layers: int, expected_full: list[int]) -> None:
    cfg = json.loads(json.dumps(base_config))
    t = cfg["text_config"]
    t.pop("layer_types")
    t.pop("full_attention_interval")
    if interval is not None:
        t["full_attention_interval"] = interval
    t["num_hidden_layers"] = num_layers
    hp = HParams.from_config(read_config(_write(tmp_path, cfg)))
    assert [i for i, k in enumerate(hp.layer_types) if k == FULL] == expected_full  # (i+1) % interval == 0
    assert all(k == LINEAR for i, k in enumerate(hp.layer_types) if i not in expected_full)


def test_generation_config_eos_wins(tmp_path: Path, tiny_ckpt: Path) -> None:
    hp = HParams.from_config(read_config(tiny_ckpt))
    assert hp.eos_token_ids == (510, 511)  # generation_config.json's list, not text_config's 511


# ------------------------------------------------------------------------------------------- bad checkpoints
@pytest.fixture
def ckpt_copy(tiny_ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("model-*-of-*.safetensors"))


def test_missing_shard_from_pretrained(ckpt_copy: Path) -> None:
    shard = _shards(ckpt_copy)[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"names shard '{shard.name}', which does not exist"):
        Engine.from_pretrained(ckpt_copy)


def test_truncated_shard_from_pretrained(ckpt_copy: Path) -> None:
    shard = _shards(ckpt_copy)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        Engine.from_pretrained(ckpt_copy)


def test_bad_config_from_pretrained(ckpt_copy: Path) -> None:
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["text_config"]["num_key_value_heads"] = 3
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        Engine.from_pretrained(ckpt_copy)


def test_cli_reports_bad_checkpoint(ckpt_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = _shards(ckpt_copy)[0]
    shard.write_bytes(shard.read_bytes()[:-1000])
    assert main(["generate", str(ckpt_copy), "--prompt-ids", "1,2,3", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: ") and "truncated" in err
    assert err.count("\n") == 1


def test_cli_reports_missing_shard(ckpt_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _shards(ckpt_copy)[1].unlink()
    assert main(["generate", str(ckpt_copy), "--prompt-ids", "1,2,3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: ") and "does not exist" in err and err.count("\n") == 1
