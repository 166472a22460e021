"""The joint forward pass on a GPU (tandem/models/qwen3_5/cuda_joint.py): several sequences' decode steps and verify
trees in one pass give every item, bit for bit, what its ``decode`` / ``verify_tree`` gives alone (logits, the state
after a decode, the scratch and the state after a commit), on small synthetic models of every weight format, with
the fused layer loop (≤ 4 rows) and the plain one, across passes split at JOINT_ROWS; a bad item fails alone. And
the engine with ``parallel`` slots on the GPU (joint rounds on): each request's tokens alone == beside others."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal, root_path  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.engine import DEFAULT_MODEL, Engine  # noqa: E402
from tandem.models.protocol import JointItem  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

TINY = dict(layers=4, hidden=512, mlp=1024, vocab=1024, heads=4, kv_heads=2, head_dim=64, gdn_k_heads=4,
            gdn_v_heads=8, gdn_dim=64, conv_taps=4, attn_every=2, rotary_dim=16)
PROMPT_LENGTHS = [21, 40, 7, 66]
# each mix: per sequence None (a decode step) or a tree's parents
MIXES = [
    [None, None, None],                                   # 3 rows: the fused loop
    [None, [-1, 0, 1, 1, 0], None],                       # 7 rows: the plain loop
    [[-1, 0, 0], [-1, 0, 1, 2, 1, 0, 5, 3], None, [-1]],  # 13 rows
    [[-1] + list(range(19)), [-1] + list(range(15)), None, None],  # 38 rows: two passes
]


def _bits(a: Any) -> np.ndarray:
    return np.ascontiguousarray(cp.asnumpy(a)).view(np.uint32)


@pytest.fixture(scope="module", params=["bf16", "fp8", "nvfp4"])
def model(request: pytest.FixtureRequest) -> Any:
    from bench.decode import build

    cp.random.seed(2)
    return build(request.param, TINY)


def _states(model: Any, rng: np.random.Generator) -> tuple[list[list[int]], list[Any], list[Any]]:
    prompts = [rng.integers(0, TINY["vocab"], n).tolist() for n in PROMPT_LENGTHS]
    joint, alone = [], []
    for p in prompts:
        for group in (joint, alone):
            s = model.new_state(len(p) + 48)
            model.prefill(s, p)
            group.append(s)
    return prompts, joint, alone


@pytest.mark.parametrize("mix", range(len(MIXES)), ids=[f"mix{i}" for i in range(len(MIXES))])
def test_joint_pass_equals_each_item_alone(model: Any, mix: int) -> None:
    assert model.capabilities.joint_rounds
    rng = np.random.default_rng(mix)
    prompts, joint, alone = _states(model, rng)
    kinds = MIXES[mix]
    items, refs, scratches = [], [], []
    for j, parents in enumerate(kinds):
        if parents is None:
            token = int(rng.integers(0, TINY["vocab"]))
            items.append(JointItem(joint[j], [token]))
            refs.append(model.decode(alone[j], token))
            scratches.append(None)
        else:
            tokens = rng.integers(0, TINY["vocab"], len(parents)).tolist()
            sj, sa = model.new_tree_scratch(32), model.new_tree_scratch(32)
            items.append(JointItem(joint[j], tokens, parents, sj))
            refs.append(model.verify_tree(alone[j], sa, tokens, parents))
            scratches.append((sj, sa, parents))
    got = model.joint_forward(items)
    for j, parents in enumerate(kinds):
        np.testing.assert_array_equal(_bits(got[j]), _bits(refs[j]), err_msg=f"item {j} logits")
        if parents is None:
            assert joint[j].length == alone[j].length
            assert_states_equal(joint[j], alone[j])
            continue
        sj, sa, _ = scratches[j]
        n = len(parents)
        np.testing.assert_array_equal(_bits(sj.hidden_device[:n]), _bits(sa.hidden_device[:n]),
                                      err_msg=f"item {j} hidden")
        path = root_path(parents, n - 1)
        model.commit(joint[j], sj, path)
        model.commit(alone[j], sa, path)
        assert_states_equal(joint[j], alone[j])


@pytest.mark.parametrize("count", [3, 6])
def test_planned_joint_decode_replays_with_the_bits_alone(model: Any, count: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-only passes run through a recorded plan (fused loop at 3 rows, plain at 6): the recording and its
    replays equal each state's own decode steps, bit for bit, logits and states."""
    monkeypatch.setattr(type(model), "JOINT_PLANNED", True)
    rng = np.random.default_rng(count)
    prompts = [rng.integers(0, TINY["vocab"], int(rng.integers(3, 70))).tolist() for _ in range(count)]
    joint, alone = [], []
    for p in prompts:
        for group in (joint, alone):
            s = model.new_state(len(p) + 16)
            model.prefill(s, p)
            group.append(s)
    model.release_joint_plans()
    for step in range(5):
        tokens = rng.integers(0, TINY["vocab"], count).tolist()
        got = model.joint_forward([JointItem(s, [t]) for s, t in zip(joint, tokens)])
        for j in range(count):
            want = model.decode(alone[j], tokens[j])
            np.testing.assert_array_equal(_bits(got[j]), _bits(want), err_msg=f"step {step} item {j}")
    for j in range(count):
        assert_states_equal(joint[j], alone[j])
    assert len(model._joint_plans) == 1  # one set of states: recorded once, replayed since


def test_a_bad_item_fails_alone(model: Any) -> None:
    rng = np.random.default_rng(9)
    _, joint, alone = _states(model, rng)
    items = [JointItem(joint[0], [5]), JointItem(joint[1], [TINY["vocab"] + 3]), JointItem(joint[2], [7])]
    got = model.joint_forward(items)
    assert isinstance(got[1], ValueError)
    np.testing.assert_array_equal(_bits(got[0]), _bits(model.decode(alone[0], 5)))
    np.testing.assert_array_equal(_bits(got[2]), _bits(model.decode(alone[2], 7)))
    assert joint[1].length == PROMPT_LENGTHS[1]


PROMPTS_TEXT = ["def fib(n):", "The weather in Paris", "import os\nimport sys\n" * 3, "1, 2, 3, 4, 5,"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.7, top_k=30, seed=77, max_tokens=36, ignore_eos=True)]


@pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="no embedded model")
@pytest.mark.parametrize("spec", ["off", "mtp", "auto"])
def test_engine_slots_on_the_gpu_give_each_request_its_bits_alone(spec: str) -> None:
    alone = Engine.from_pretrained(device="cuda", spec=spec, cache="off")
    want = []
    for p, params in zip(PROMPTS_TEXT, PARAMS):
        done = alone.complete(p, params)
        want.append((done.token_ids, [(lp.token_id, lp.logprob) for lp in done.logprobs]))
    del alone
    engine = Engine.from_pretrained(device="cuda", spec=spec, cache="off", parallel=4)
    engine.spec_max_running = 4  # trees in the joint passes too (by default slots beside others take plain steps)
    assert engine.rounds is not None
    for mix in ([0, 1, 2, 3], [3, 2, 1], [1, 1, 0, 2]):
        results: list[Any] = [None] * len(mix)
        go = threading.Barrier(len(mix))

        def run(j: int) -> None:
            go.wait()
            done = engine.complete(PROMPTS_TEXT[mix[j]], PARAMS[mix[j]])
            results[j] = (done.token_ids, [(lp.token_id, lp.logprob) for lp in done.logprobs])

        threads = [threading.Thread(target=run, args=(j,)) for j in range(len(mix))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        for j, i in enumerate(mix):
            assert results[j] == want[i], f"{spec}: request {i} beside {mix} differs from alone"
    assert engine.rounds.items > engine.rounds.passes  # passes carried several slots' rows
