"""NaN and inf: refused at checkpoint load, and named when logits turn non-finite (never decoded as text)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.engine import Engine
from tandem.sampling import NonFiniteLogitsError, SamplingParams, choose_token
from tools.make_checkpoint import write_checkpoint


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_choose_token_names_non_finite_logits(bad: float, temperature: float) -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    x[17] = bad
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        choose_token(x, SamplingParams(temperature=temperature), None, seed=1, position=0)
    masked = np.full(64, -np.inf, dtype=np.float32)
    masked[3] = 0.5  # -inf is a mask, not a fault
    assert choose_token(masked, SamplingParams(temperature=temperature), None, seed=1, position=0) == 3


def test_checkpoint_tensor_with_nan_is_refused(tmp_path: Path) -> None:
    w = np.ones((4, 4), dtype=np.float32)
    w[1, 2] = np.nan
    save_file({"a": w, "b": np.ones(3, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    assert ckpt.get("b").tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(CheckpointError, match=r"'a' holds 1 non-finite"):
        ckpt.get("a")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_engine_with_nan_weights_raises_instead_of_writing_text(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, with_vision=False, with_mtp=False, num_shards=1, seed=3)
    engine = Engine.from_pretrained(tmp_path, max_context=64)
    engine.model.weights.norm[:] = np.nan  # as a broken export would leave it, past the load check
    for t in (0.0, 1.0):
        with pytest.raises(NonFiniteLogitsError):
            engine.complete([1, 2, 3], SamplingParams(temperature=t, max_tokens=4))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_gate_refuses_a_model_with_non_finite_logits(tmp_path: Path) -> None:
    from tandem.gate import GateInputError, next_token_figures

    write_checkpoint(tmp_path, with_vision=False, with_mtp=False, num_shards=1, seed=4)
    model = Engine.from_pretrained(tmp_path, max_context=64).model
    assert np.isfinite(next_token_figures(model, [1, 2, 3, 4])[0]).all()
    model.weights.norm[:] = np.inf
    with pytest.raises(GateInputError, match="not finite"):
        next_token_figures(model, [1, 2, 3, 4])
