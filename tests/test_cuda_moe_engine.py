"""The MoE adapters on the GPU (tandem/models/qwen3_5_moe/cuda_model.py) on small random checkpoints.

Checkpoints: Qwen3.5-MoE (VLM layout, fused BF16 experts, 6 experts top-2, MTP head), Qwen3-Next (per-expert BF16,
an unusual 7 experts top-5, a dense layer), Qwen3.5-MoE with FP8 block experts (the FP8 release layout) and Qwen3-Next
with NVFP4 experts (``tandem quantize --targets experts``). Checks: ``--device auto`` picks the CUDA model; GPU greedy
== CPU greedy (teacher-forced along the CPU path: the same argmax, smallest top-1 margin recorded); tree verify rows
== plain decodes bit for bit and commit == decoding the path; speculative output == plain on the GPU (lookup, the MTP
head, garbage and forced trees; greedy and seeded sampling); StairCut's curve priced by distinct experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal, plain_decodes, root_path  # noqa: E402
from spec_helpers import GarbageDrafter, speculating  # noqa: E402
from tandem.backend.cuda.checks import record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.models.qwen3_5_moe.cuda_model import CudaQwen3_5MoeModel  # noqa: E402
from tandem.quant import quantize_checkpoint  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tandem.speculative.lookup import LookupDrafter  # noqa: E402
from tandem.speculative.mtp_drafter import MTPDrafter  # noqa: E402
from tools.make_moe_checkpoint import write_moe_checkpoint  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=77, max_tokens=NEW_TOKENS, ignore_eos=True)
# the dense CUDA layers' shapes: GDN dk = dv = 64 (a scan kernel per dk), attention head dim a multiple of 32
SMALL = dict(num_hidden_layers=3, full_attention_interval=3, hidden_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64)
CASES: dict[str, dict[str, Any]] = {
    "moe_bf16": dict(arch="qwen3_5_moe", experts="fused", num_experts=6, num_experts_per_tok=2, seed=3, **SMALL),
    "next_bf16": dict(arch="qwen3_next", experts="per_expert", num_experts=7, num_experts_per_tok=5,
                      mlp_only_layers=(1,), seed=4, **SMALL),
    "moe_fp8": dict(arch="qwen3_5_moe", experts="per_expert", fp8=True, num_experts=6, num_experts_per_tok=2,
                    moe_intermediate_size=64, shared_expert_intermediate_size=64, seed=5, **SMALL),
    "next_nvfp4": dict(arch="qwen3_next", experts="per_expert", num_experts=5, num_experts_per_tok=3,
                       moe_intermediate_size=128, shared_expert_intermediate_size=128, seed=6, **SMALL),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kw = dict(CASES[request.param])
    root = tmp_path_factory.mktemp(request.param)
    path = write_moe_checkpoint(root / "src", **kw)
    if request.param.endswith("nvfp4"):
        quantize_checkpoint(path, root / "q", "nvfp4", targets=["experts"])
        path = root / "q"
    return path


@pytest.fixture(scope="module")
def engines(ckpt: Path) -> tuple[Engine, Engine]:
    return Engine.from_pretrained(ckpt, device="cpu"), Engine.from_pretrained(ckpt, device="cuda")


def _prompts(vocab: int, seed: int, num: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        ids = rng.integers(0, vocab, int(rng.integers(3, 40))).tolist()
        out.append(ids * 3 if i % 2 else ids)
    return out


def test_auto_device_picks_the_cuda_model(ckpt: Path, engines: tuple[Engine, Engine]) -> None:
    assert isinstance(engines[1].model, CudaQwen3_5MoeModel)
    assert isinstance(Engine.from_pretrained(ckpt, device="auto").model, CudaQwen3_5MoeModel)
    routing = engines[1].model.capabilities.expert_routing
    assert routing is not None and routing[0] >= routing[1] >= 1 and 0.0 < routing[2] < 1.0, routing


def test_gpu_greedy_equals_the_cpu(ckpt: Path, engines: tuple[Engine, Engine]) -> None:
    cpu, gpu = engines
    margins, diffs = [], []
    for ids in _prompts(cpu.vocab_size, 1):
        want = cpu.complete(ids, GREEDY).token_ids
        hs, ds = cpu.model.new_state(len(ids) + NEW_TOKENS), gpu.model.new_state(len(ids) + NEW_TOKENS)
        hl, dl = cpu.model.prefill(hs, ids), gpu.model.prefill(ds, ids)
        for step, token in enumerate(want):  # teacher-forced along the CPU path
            d = cp.asnumpy(dl)
            top = np.sort(hl)[-2:]
            margins.append(float(top[1] - top[0]))
            diffs.append(float(np.max(np.abs(d - hl)) / max(float(np.max(np.abs(hl))), 1e-30)))
            assert int(np.argmax(d)) == int(np.argmax(hl)) == token, \
                f"{ckpt.parent.name}: step {step}: GPU argmax {int(np.argmax(d))} != CPU {token} (CPU top-1 margin " \
                f"{margins[-1]:.3g}, rel. logit diff {diffs[-1]:.3g})"
            if hs.length < hs.max_len:
                hl, dl = cpu.model.decode(hs, token), gpu.model.decode(ds, token)
        got = gpu.complete(ids, GREEDY).token_ids
        assert got == want, f"{ckpt.parent.name}: GPU engine greedy differs at " \
            f"{next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
    record(f"cuda_moe_greedy_parity_{ckpt.parent.name}", min_top1_margin=min(margins), max_rel_logit_diff=max(diffs))
    print(f"\n[{ckpt.parent.name}] smallest top-1 margin {min(margins):.4g}, largest rel. logit diff {max(diffs):.3g}")


@pytest.mark.parametrize("parents", [[-1, 0, 1, 2], [-1, 0, 1, 2, 1, 0, 5, 3, 7, 0], [-1] + [0] * 15],
                         ids=["chain4", "tree10", "bush16"])
def test_verify_rows_and_commit_are_plain_decodes(engines: tuple[Engine, Engine], parents: list[int]) -> None:
    model = engines[1].model
    prompt = _prompts(model.hp.vocab_size, 2, 1)[0]
    tokens = np.random.default_rng(len(parents)).integers(0, model.hp.vocab_size, len(parents)).tolist()
    state = model.new_state(len(prompt) + 20)
    model.prefill(state, prompt)
    scratch = model.new_tree_scratch(16)
    for _ in range(2):  # the recording and a replay
        rows = cp.asnumpy(model.verify_tree(state, scratch, tokens, parents))
        for node in range(len(parents)):
            _, want = plain_decodes(model, prompt, [tokens[n] for n in root_path(parents, node)])
            np.testing.assert_array_equal(rows[node], cp.asnumpy(want), err_msg=f"node {node} of {len(parents)}")
    path = root_path(parents, len(parents) - 1)
    model.commit(state, scratch, path)
    ref, _ = plain_decodes(model, prompt, [tokens[n] for n in path])
    assert_states_equal(state, ref)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_spec_equals_plain_on_the_gpu(ckpt: Path, engines: tuple[Engine, Engine], params: SamplingParams) -> None:
    gpu = engines[1]
    head = gpu.model.draft_heads()
    drafters: list[Any] = [LookupDrafter(), GarbageDrafter(gpu.vocab_size, 3, "mixed", seed=5)]
    if head is not None:
        drafters.insert(1, MTPDrafter(head, steps=3, max_branch=2))
    forced = speculating(gpu, drafters, max_nodes=16)
    auto = Engine.from_pretrained(ckpt, device="cuda", spec="auto")
    trees = 0
    for p in _prompts(gpu.vocab_size, 3):
        want = gpu.complete(p, params).token_ids
        for spec in (forced, auto):
            done = spec.complete(p, params)
            assert done.token_ids == want, f"{ckpt.parent.name}: speculative output differs at " \
                f"{next(i for i, (a, b) in enumerate(zip(done.token_ids, want)) if a != b)}"
            assert done.stats is not None
            trees += sum(r.num_nodes > 1 for r in done.stats.rounds)
    assert trees > 0


def test_staircut_prices_distinct_experts(engines: tuple[Engine, Engine]) -> None:
    """The speculator's curve for a routed model: verifies dearer than the dense curve by the expected extra
    experts' share (PriceCurve.with_routing)."""
    from tandem.speculative.speculator import Speculator, load_curve

    model = engines[1].model
    spec = Speculator(model, [LookupDrafter()], max_nodes=16)
    dense = load_curve("model", 16, model.capabilities.profile_device)
    assert spec.curve.ms[1] == dense.ms[1]
    assert all(spec.curve.ms[n] > dense.ms[n] for n in range(2, 17)), (spec.curve.ms, dense.ms)


def test_prefill_equals_decoding_token_by_token(engines: tuple[Engine, Engine]) -> None:
    """Capabilities.prefill_matches_decode holds for the MoE layers too: a prefill (pieces of up to 64 rows, the
    experts' four-tile kernel) leaves the state and logits of decoding the prompt one token at a time."""
    model = engines[1].model
    prompt = _prompts(model.hp.vocab_size, 5, 2)[1][:100]
    state = model.new_state(len(prompt) + 1)
    logits = cp.asnumpy(model.prefill(state, prompt))
    ref, want = plain_decodes(model, prompt[:1], prompt[1:])
    np.testing.assert_array_equal(logits, cp.asnumpy(want), err_msg="prefill logits != decode logits")
    assert_states_equal(state, ref)
