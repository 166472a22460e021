"""What the host model's companions read from it: the tree verbs (verify.py), the MTP head (mtp.py) and the CUDA
model built from it (cuda_model.py). A Protocol, so they need not import model.py, which imports them;
``Qwen3_5Model`` satisfies it (mypy checks it where model.py binds verify.py's functions as its methods).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.config import RawConfig
from tandem.formats import Linear
from tandem.models.qwen3_5.hparams import HParams
from tandem.models.qwen3_5.weights import AttnWeights, GDNWeights, LayerWeights, ModelWeights

MatMul = Callable[[Linear, np.ndarray], np.ndarray]


class HostModel(Protocol):
    """The loaded NumPy Qwen3.5 model (tandem/models/qwen3_5/model.py ``Qwen3_5Model``) as its companions see it.

    Attributes: hp; weights (fp32 weights and Linears); head (the output Linear [V, E]); raw (the config, or
    None); path (the checkpoint directory, or None); kv_dtype (the KV rows' storage, "float32" / "bfloat16");
    mrope_section (the 3-D rotary split of image prompts' rows, mrope.py).
    """

    hp: HParams
    kv_dtype: str
    weights: ModelWeights
    head: Linear
    raw: RawConfig | None
    path: Path | None
    mrope_section: tuple[int, int, int]

    def draft_heads(self) -> Any:
        """The checkpoint's MTP head, or None."""
        ...

    def _mlp(self, lw: LayerWeights, h: np.ndarray, mm: MatMul) -> np.ndarray: ...

    def attention_qkv(self, w: AttnWeights, h: np.ndarray, positions: np.ndarray, mm: MatMul
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...

    def attention_output(self, w: AttnWeights, a: np.ndarray, gate: np.ndarray, mm: MatMul) -> np.ndarray: ...

    def gdn_output(self, w: GDNWeights, o: np.ndarray, z: np.ndarray, mm: MatMul) -> np.ndarray: ...
