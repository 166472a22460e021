"""The quality gate: figures, thresholds, default texts and exit codes (tandem/gate.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.gate import GateInputError, TextFigures, check, distinct4, load_profile, longest_repeat, read_texts
from tandem.quant import quantize_checkpoint
from tools.make_checkpoint import write_checkpoint
from tools.make_tokenizer import train_tokenizer

PROSE = ("The quick brown fox jumps over the lazy dog. A gate compares a quantised model with its base on text it "
         "has not seen, and refuses the candidate when the loss grows by more than a few hundredths of a nat. ") * 3
CODE = ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n\n"
        "for i in range(10):\n    print(i, gcd(i, 12))\n") * 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """base (random tiny model + trained tokenizer), its NVFP4 twin, an unrelated model, and two text files."""
    root = tmp_path_factory.mktemp("gate")
    base = write_checkpoint(root / "base", num_shards=1, with_vision=False, with_mtp=False)
    train_tokenizer([PROSE, CODE], 300, base)
    quantize_checkpoint(base, root / "nvfp4", "nvfp4", targets=["mlp"])
    other = write_checkpoint(root / "other", num_shards=1, with_vision=False, with_mtp=False, seed=7)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / f, other / f)
    (root / "prose.txt").write_text(PROSE)
    (root / "code.txt").write_text(CODE)
    return {"base": base, "nvfp4": root / "nvfp4", "other": other, "prose": root / "prose.txt",
            "code": root / "code.txt", "root": root}


def _gate(m: dict[str, Path], cand: str, *extra: str) -> int:
    return main(["gate", str(m["base"]), str(m[cand]), "--text", str(m["prose"]), str(m["code"]),
                 "--max-tokens", "48", "--gen-tokens", "8", *extra])


def test_gate_self_passes_with_zero_delta(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert _gate(models, "base", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and [t["name"] for t in out["texts"]] == ["prose.txt", "code.txt"]
    for t in out["texts"]:
        assert t["nll_delta"] == 0.0 and t["top1_agree"] == 1.0 and t["num_tokens"] == 48
    for g in out["generation"]:
        assert g["first_divergence"] == 8 and g["distinct4_base"] == g["distinct4_cand"]


def test_gate_quantised_figures_and_unrelated_model_fails(models: dict[str, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    _gate(models, "nvfp4")
    table = capsys.readouterr().out
    assert "NLL delta, worst text" in table and "greedy generation" in table
    assert _gate(models, "other") == 1
    out = capsys.readouterr().out
    assert "FAIL  NLL delta" in out and "gate FAILED" in out


def test_gate_bad_input_exits_2(models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tandem.engine.DEFAULT_MODEL", tmp_path / "no_default_model")
    assert main(["gate", str(models["base"]), str(models["nvfp4"])]) == 2  # no texts, no held-out prompts
    assert "heldout_prompts.json" in capsys.readouterr().err
    assert _gate(models, "nvfp4", "--profile", str(tmp_path / "nope.json")) == 2
    (tmp_path / "one.txt").write_text("x")
    assert main(["gate", str(models["base"]), str(models["nvfp4"]), "--text", str(tmp_path / "one.txt")]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert main(["gate", str(models["base"]), str(tmp_path), "--text", str(models["prose"])]) == 2


def test_default_texts_from_heldout_prompts(models: dict[str, Path], tmp_path: Path) -> None:
    prompts = ["    x = f(y)[0]\n    return {k: v for k, v in x}\n", "This module explains the reasons why.\n",
               "if a:\n    b()\n", "Read the file and return its text, or None.\n"]
    (tmp_path / "heldout_prompts.json").write_text(json.dumps(prompts))
    texts = read_texts([], tmp_path, tmp_path / "absent")
    assert [n for n, _ in texts] == ["heldout-prose", "heldout-code"]
    assert "explains" in texts[0][1] and "Read the file" in texts[0][1] and "return {k" in texts[1][1]
    (tmp_path / "list.json").write_text(json.dumps(["a b c", "d e f"]))
    assert [n for n, _ in read_texts([str(tmp_path / "list.json")], tmp_path, tmp_path)] == ["list[0]", "list[1]"]
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(GateInputError, match="list of strings"):
        read_texts([str(tmp_path / "bad.json")], tmp_path, tmp_path)


def test_repetition_figures_and_thresholds() -> None:
    assert distinct4([1, 2, 3, 4, 1, 2, 3, 4]) == 4 / 5 and distinct4([1, 2]) == 1.0
    assert longest_repeat([1, 2, 3, 4, 1, 2, 3, 9]) == 3 and longest_repeat([5, 5, 5, 5]) == 3
    assert longest_repeat([1, 2, 3]) == 0
    thr = load_profile(None)
    assert thr["max_nll_delta_nats"] == 0.05
    figs = [TextFigures("a", 10, 2.0, 2.04, 0.9, 1.0, 3), TextFigures("b", 10, 2.0, 2.06, 0.9, 1.0, 3)]
    res = check(figs, [], thr)
    assert not res.passed and res.checks[0][1] == pytest.approx(0.06)  # the worse text decides
    assert check(figs[:1], [], thr).passed
