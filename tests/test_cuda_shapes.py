"""The GPU engine on shapes beyond the released models' (tandem/models/qwen3_5/cuda_limits.py says it serves them):
tiny random checkpoints with GDN key head sizes 32 and 256, and one with hidden / MLP / vocabulary sizes off the
GEMV tiles, loaded with ``--device cuda``, against the CPU engine.

Checks: the check passes and the engine is the CUDA model; teacher-forced logits of a prefill and of decode steps
within relative 1e-3 of the CPU's (BF16 weights, exact on both; only accumulation orders differ); greedy tokens
equal to the CPU engine's (the smallest top-1 margin recorded); a 4-node tree verify's rows equal to plain decodes
of their paths, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda.checks import record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.models.qwen3_5.cuda_limits import cuda_limit  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tools.make_checkpoint import write_checkpoint  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# (name, write_checkpoint overrides): GDN dk 32 (dv 32) and dk 256 (dv 64); attention head dim 32 and 64
SHAPES = {
    "dk32": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32),
    "dk256": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                  linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=256,
                  linear_value_head_dim=64),
    # hidden, MLP and vocabulary sizes off the GEMV tiles (in % 32 != 0: the CUDA-core GEMV, no fused decode)
    "e80": dict(hidden_size=80, intermediate_size=200, vocab_size=500, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                linear_value_head_dim=32),
}
PROMPT = [3, 17, 99, 4, 250, 8, 41, 77, 12, 5, 300, 2, 64, 129, 7]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Engine, Engine]:
    path: Path = write_checkpoint(tmp_path_factory.mktemp(request.param), num_hidden_layers=4,
                                  full_attention_interval=2, init_std=0.1, seed=11, num_shards=1, with_vision=False,
                                  with_mtp=False, **SHAPES[request.param])
    cpu = Engine.from_pretrained(path, device="cpu", cache="off")
    assert cuda_limit(cpu.model.hp) is None, f"{request.param}: {cuda_limit(cpu.model.hp)}"
    gpu = Engine.from_pretrained(path, device="cuda", cache="off")
    return request.param, cpu, gpu


def _host(x: Any) -> np.ndarray:
    return np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float32)


def test_the_gpu_engine_is_the_cuda_model(engines: tuple[str, Engine, Engine]) -> None:
    from tandem.models.qwen3_5.cuda_model import CudaQwen3_5Model

    name, _, gpu = engines
    assert isinstance(gpu.model, CudaQwen3_5Model), f"{name}: {type(gpu.model).__name__}"


@pytest.mark.parametrize("tc", [False, True], ids=["decode-bits-prefill", "tc-prefill"])
def test_logits_follow_the_cpu(engines: tuple[str, Engine, Engine], tc: bool) -> None:
    """GPU logits against the CPU's after a prefill and decode steps: within fp32 rounding (1e-3) where the GPU
    prefills with decode's arithmetic; within bf16 rounding (3e-2) after the tensor-core prefill (bf16 operands),
    where the shape takes it."""
    name, cpu, gpu = engines
    if not tc:
        gpu.model.TC_PREFILL = False
    try:
        hs, ds = cpu.model.new_state(64), gpu.model.new_state(64)
        errs = [rel_error(_host(gpu.model.prefill(ds, PROMPT)), _host(cpu.model.prefill(hs, PROMPT)))]
        for tok in (5, 250, 9, 31, 400, 1):
            errs.append(rel_error(_host(gpu.model.decode(ds, tok)), _host(cpu.model.decode(hs, tok))))
    finally:
        gpu.model.__dict__.pop("TC_PREFILL", None)
    bound = 3e-2 if tc and gpu.model.tensor_core_prefill() is not None else 1e-3
    assert max(errs) <= bound, f"{name}: GPU vs CPU logits, relative error per step {[f'{e:.2g}' for e in errs]}"
    record(f"shapes_logits[{name}{'-tc' if tc else ''}]", max_rel=max(errs))


def test_greedy_equals_the_cpu(engines: tuple[str, Engine, Engine]) -> None:
    name, cpu, gpu = engines
    want = cpu.complete(PROMPT, GREEDY).token_ids
    got = gpu.complete(PROMPT, GREEDY).token_ids
    hs = cpu.model.new_state(64)
    logits = _host(cpu.model.prefill(hs, PROMPT + list(want[:-1]), all_logits=True))[len(PROMPT) - 1:]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    margin = float(np.min(top2[:, 1] - top2[:, 0]))
    assert got == want, f"{name}: GPU greedy {got} != CPU greedy {want} (smallest CPU top-1 margin {margin:.3g})"
    record(f"shapes_greedy[{name}]", tokens=len(want), min_margin=margin)


def test_tree_verify_equals_decodes(engines: tuple[str, Engine, Engine]) -> None:
    name, _, gpu = engines
    m = gpu.model
    state = m.new_state(64)
    m.prefill(state, PROMPT)
    ids, parents = [7, 21, 300, 44], [-1, 0, 0, 1]
    rows = _host(m.verify_tree(state, m.new_tree_scratch(4), ids, parents))
    for node, path in ((0, [0]), (1, [0, 1]), (2, [0, 2]), (3, [0, 1, 3])):
        plain = m.new_state(64)
        m.prefill(plain, PROMPT)
        for x in path:
            want = _host(m.decode(plain, ids[x]))
        assert np.array_equal(rows[node], want), f"{name}: tree node {node} != a decode of its path {path}"
