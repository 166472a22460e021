"""The engine on the GPU (``--device cuda``, tandem/models/qwen3_5/cuda_model.py) on the embedded default model.

Checks: (a) greedy parity with the CPU engine on the 10 held-out prompts × 64 tokens, the smallest top-1 margin
and the largest logit difference recorded; (b) speculative == plain on the GPU (lookup, mtp, auto and a forced
tree policy; greedy and seeded sampling), the device MTP head following the host's; (c) tree verify rows and commit == plain decodes, bit for bit, and (on the fallback prefill with decode's
arithmetic) decode after prefill == a prefill of the longer prompt, logits and states bit for bit at piece
boundaries ±1; (d) device memory flat over 200 decode steps; a calibrate smoke.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal, decode_bits_prefill, plain_decodes, root_path  # noqa: E402
from spec_helpers import GarbageDrafter, speculating  # noqa: E402
from tandem.backend.cuda.checks import record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.engine import DEFAULT_MODEL, Engine  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tandem.speculative.lookup import LookupDrafter  # noqa: E402
from tandem.speculative.mtp_drafter import MTPDrafter  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU"),
              pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="no embedded model")]

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu() -> Engine:
    return Engine.from_pretrained(device="cuda")


@pytest.fixture(scope="module")
def cpu() -> Engine:
    return Engine.from_pretrained(device="cpu")


@pytest.fixture(scope="module")
def prompts(gpu: Engine) -> list[list[int]]:
    texts = json.loads((DEFAULT_MODEL / "heldout_prompts.json").read_text())
    ids = [gpu.encode_prompt(t) for t in texts]
    return [p * 2 if i % 2 else p for i, p in enumerate(ids)]  # repeats give prompt lookup matches


def test_gpu_engine_is_the_cuda_model(gpu: Engine) -> None:
    from tandem.models.qwen3_5.cuda_model import CudaQwen3_5Model

    assert isinstance(gpu.model, CudaQwen3_5Model)
    assert Engine.from_pretrained(device="auto").model.__class__ is CudaQwen3_5Model


def _top2_margin(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def test_greedy_parity_with_the_cpu(gpu: Engine, cpu: Engine) -> None:
    texts = json.loads((DEFAULT_MODEL / "heldout_prompts.json").read_text())
    assert len(texts) == 10
    margins, diffs = [], []
    for text in texts:
        ids = cpu.encode_prompt(text)
        want = cpu.complete(ids, GREEDY).token_ids
        got = gpu.complete(ids, GREEDY).token_ids
        assert got == want, f"differs at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
        hs, ds = cpu.model.new_state(len(ids) + NEW_TOKENS), gpu.model.new_state(len(ids) + NEW_TOKENS)
        hl, dl = cpu.model.prefill(hs, ids), gpu.model.prefill(ds, ids)
        for token in want:  # teacher-forced along the CPU path: margins and the logits' distance
            d = cp.asnumpy(dl)
            margins.append(_top2_margin(hl))
            diffs.append(float(np.max(np.abs(d - hl)) / max(float(np.max(np.abs(hl))), 1e-30)))
            assert int(np.argmax(d)) == int(np.argmax(hl)) == token
            if hs.length < hs.max_len:
                hl, dl = cpu.model.decode(hs, token), gpu.model.decode(ds, token)
    record("cuda_engine_greedy_parity", prompts=len(texts), tokens=NEW_TOKENS, min_top1_margin=min(margins),
           max_rel_logit_diff=max(diffs))
    print(f"\n[gpu parity] smallest top-1 margin {min(margins):.4g}, largest rel. logit diff {max(diffs):.3g}")


def test_greedy_parity_with_the_cpu_in_both_kv_storages(gpu: Engine, cpu: Engine) -> None:
    """The default engines store KV rows in bf16 (the parity above); with fp32 rows on both sides the GPU's greedy
    tokens equal the CPU's too, and the two storages' device states hold what their dtype says."""
    assert gpu.model.kv_dtype == cpu.model.kv_dtype == "bfloat16"
    gpu32 = Engine.from_pretrained(device="cuda", kv_dtype="fp32")
    cpu32 = Engine.from_pretrained(device="cpu", kv_dtype="fp32")
    texts = json.loads((DEFAULT_MODEL / "heldout_prompts.json").read_text())[:4]
    for text in texts:
        ids = cpu32.encode_prompt(text)
        want, got = cpu32.complete(ids, GREEDY).token_ids, gpu32.complete(ids, GREEDY).token_ids
        assert got == want, f"fp32 KV: differs at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
    views = [s.name for s in gpu32.model.new_state(8).specs if s.kind == "view"]
    assert views and all(gpu32.model.new_state(8).buffers[n].dtype == np.float32 for n in views)
    assert all(gpu.model.new_state(8).buffers[n].dtype == np.uint16 for n in views)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["lookup", "mtp", "auto", "forced"])
def test_spec_equals_plain_on_the_gpu(gpu: Engine, prompts: list[list[int]], mode: str,
                                      params: SamplingParams) -> None:
    if mode == "forced":  # every round verifies a tree (no StairCut): lookup, MTP and garbage guesses
        spec = speculating(gpu, [LookupDrafter(), MTPDrafter(gpu.model.draft_heads(), steps=3, max_branch=2),
                                 GarbageDrafter(gpu.vocab_size, 3, "mixed", seed=5)], max_nodes=16)
    else:
        spec = Engine.from_pretrained(device="cuda", spec=mode)
    trees = 0
    for p in prompts:
        want = gpu.complete(p, params).token_ids
        done = spec.complete(p, params)
        assert done.token_ids == want, f"{mode}: differs at " \
            f"{next(i for i, (a, b) in enumerate(zip(done.token_ids, want)) if a != b)}"
        assert done.stats is not None
        trees += sum(r.num_nodes > 1 for r in done.stats.rounds)
    if mode == "forced":
        assert trees > 0
    print(f"\n[gpu spec {mode}] {trees} verified trees")


def _mtp_inputs(cpu: Engine, hh: Any, dh: Any, p: list[int]) -> tuple[np.ndarray, list[int], Any, Any]:
    """The MTP heads' inputs for prompt p: the CPU target's hidden rows [T, E], the shifted ids, fresh host and
    device head states."""
    state = cpu.model.new_state(len(p) + 8)
    hidden: list[np.ndarray] = []
    cpu.model.prefill(state, p, hidden_out=hidden)
    return np.concatenate(hidden), p[1:] + [p[0]], hh.new_state(len(p) + 8), dh.new_state(len(p) + 8)


def test_the_device_mtp_head_follows_the_host_head(prompts: list[list[int]]) -> None:
    """The GPU engine drafts with the device MTP head (cuda_mtp.py): its rows follow the host head's on the same
    inputs (the target's CPU hidden states), and a 4-step chain picks the host's ids wherever the host's best two
    logits differ by more than 1e-3; the largest relative difference and the smallest margin are recorded.
    With fp32 KV rows: the GPU's and the CPU's fp32 rows differ in their last bits, which bf16 storage turns into
    whole-ulp flips of a few elements (the repeated prompt's MTP rows then differ by up to 2.1e-2 on the H200), so
    the 2e-3 bound is an fp32 one."""
    from tandem.models.qwen3_5.cuda_mtp import CudaMTPHead

    gpu = Engine.from_pretrained(device="cuda", kv_dtype="fp32")
    gpu.model.TC_PREFILL = False  # the head's catch-up then runs decode's attention (beside the tensor-core
    # prefill it runs the flash prefill's bf16 operands: within ~1e-2, test_the_device_mtp_head_beside_the_tc_prefill)
    cpu = Engine.from_pretrained(device="cpu", kv_dtype="fp32")
    dh, hh = gpu.model.draft_heads(), cpu.model.draft_heads()
    assert isinstance(dh, CudaMTPHead) and hh is not None
    worst, margins, steps = 0.0, [], 0
    for p in prompts[:5]:
        h, toks, hs, ds = _mtp_inputs(cpu, hh, dh, p)
        for a in range(0, len(p), 64):  # the catch-up's pieces
            want = hh.forward(hs, toks[a:a + 64], h[a:a + 64], a)
            got = cp.asnumpy(dh.forward(ds, toks[a:a + 64], h[a:a + 64], a))
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
            worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
        hw, hg = want[-1:], cp.asarray(got[-1:])
        for step in range(4):  # a chain: each head feeds its own output; the token is the host's best
            wi, wp = hh.top_probs(hw, 3)
            gi, gp = dh.top_probs(hg, 3)
            logits = hh.logits(hw)[0]
            margin = float(np.sort(logits)[-1] - np.sort(logits)[-2])
            margins.append(margin)
            if margin > 1e-3:
                assert gi[0] == wi[0], f"step {step}: device {gi[0]} host {wi[0]} (margin {margin:.3g})"
            np.testing.assert_allclose(gp[0], wp[0], rtol=1e-2, atol=1e-4)
            pos = len(p) + step
            hw = hh.forward(hs, [int(wi[0])], hw, pos)
            hg = dh.forward(ds, [int(wi[0])], hg, pos)
            np.testing.assert_allclose(cp.asnumpy(hg), hw, rtol=2e-3, atol=2e-3)
            worst = max(worst, float(np.max(np.abs(cp.asnumpy(hg) - hw)) / np.max(np.abs(hw))))
            steps += 1
    record("cuda_mtp_head_vs_host", prompts=5, chain_steps=steps, max_rel_hidden_diff=worst,
           min_top1_margin=min(margins))
    print(f"\n[gpu mtp head] largest rel. hidden diff {worst:.3g}, smallest host top-1 margin {min(margins):.4g}")


def test_the_device_mtp_head_beside_the_tc_prefill(gpu: Engine, cpu: Engine, prompts: list[list[int]]) -> None:
    """Beside the tensor-core prefill the device MTP head's catch-up rows (flash attention, bf16 operands) follow the
    host head's within a bf16 tolerance, and its best guess after a prompt is the host's where the host's margin is
    clear."""
    dh, hh = gpu.model.draft_heads(), cpu.model.draft_heads()
    assert gpu.model.tensor_core_prefill() is not None
    worst = 0.0
    for p in prompts[:3]:
        h, toks, hs, ds = _mtp_inputs(cpu, hh, dh, p)
        want = hh.forward(hs, toks, h, 0)
        got = cp.asnumpy(dh.forward(ds, toks, h, 0))
        worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
        logits = hh.logits(want[-1:])[0]
        if np.sort(logits)[-1] - np.sort(logits)[-2] > 0.1:
            assert int(dh.top_probs(cp.asarray(got[-1:]), 1)[0][0]) == int(np.argmax(logits))
    record("cuda_mtp_head_tc_prefill_vs_host", max_rel_hidden_diff=worst)
    assert worst < 5e-2


def test_planned_mtp_rows_have_the_unplanned_bits(gpu: Engine) -> None:
    """A draft chain's single rows replayed from the head's launch plans (and top_probs from its top-k plan) have
    the bits of the same rows through the launchers, over several replays."""
    dh = gpu.model.draft_heads()
    rng = np.random.default_rng(4)
    hid = rng.standard_normal((8, gpu.model.hp.hidden_size)).astype(np.float32)
    toks = rng.integers(0, gpu.vocab_size, 8).tolist()
    runs = {}
    try:
        for planned in (False, True):
            dh.PLANNED = planned
            st = dh.new_state(16)
            dh.forward(st, toks[:3], hid[:3], 0)
            rows, tops = [], []
            h: Any = hid[3:4]
            for t in range(3, 8):  # a host row first, then each output fed back (the plan's own buffer)
                h = dh.forward(st, [toks[t]], h, t)
                rows.append(cp.asnumpy(h))
                tops.append(dh.top_probs(h, 3))
            assert (st.decode_plan is not None) == planned
            runs[planned] = (rows, tops, cp.asnumpy(st.buffers["layers.0.k"][:8]),
                             cp.asnumpy(st.buffers["layers.0.v"][:8]))
    finally:
        del dh.PLANNED
    for a, b in zip(runs[False][0], runs[True][0]):
        np.testing.assert_array_equal(a, b)
    for (ia, pa), (ib, pb) in zip(runs[False][1], runs[True][1]):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(pa, pb)
    np.testing.assert_array_equal(runs[False][2], runs[True][2])
    np.testing.assert_array_equal(runs[False][3], runs[True][3])


def test_the_device_chain_drafts_the_row_by_row_tree(gpu: Engine, cpu: Engine, prompts: list[list[int]]) -> None:
    """``CudaMTPHead.chain`` (each row's embedding reads the previous row's best id on the device, one host read a
    chain) gives the drafter the trees, probabilities and head cache rows of the row-by-row loop, bit for bit, over
    repeated proposals (recorded plans, then replays) and with a node limit inside the chain."""
    dh = gpu.model.draft_heads()
    assert dh._plannable()
    p = prompts[1]
    hidden: list[np.ndarray] = []
    cpu.model.prefill(cpu.model.new_state(len(p) + 8), p, hidden_out=hidden)
    chains: list[int] = []

    class Counted:  # the device head, its chain calls counted (the loop must not take them)
        def __getattr__(self, name: str) -> Any:
            return getattr(dh, name)

        def chain(self, *args: Any) -> Any:
            got = dh.chain(*args)
            chains.append(0 if got is None else len(got[0]))
            return got

    h = np.concatenate(hidden)
    runs = {}
    for use_chain in (False, True):
        d = MTPDrafter(Counted(), steps=5, branch_ratio=0.0, max_branch=3)
        d.device_chain = use_chain
        d.reset(p, h, len(p) + 8)
        frags = [d.propose(root, nodes, 5) for root, nodes in ((p[-1], 16), (3, 16), (p[0], 7), (3, 16))]
        assert [len(f) for f in frags] == [15, 15, 7, 15]
        rows = len(p) - 1 + 5
        runs[use_chain] = ([(f.token_ids, f.parents, f.confidences) for f in frags],
                           cp.asnumpy(d.state.buffers["layers.0.k"][:rows]),
                           cp.asnumpy(d.state.buffers["layers.0.v"][:rows]))
    assert chains == [5, 5, 5, 5]  # the chain ran (5 rows each: node limit 7 needs 3 rows, the chain runs 5)
    assert runs[False][0] == runs[True][0]
    np.testing.assert_array_equal(runs[False][1], runs[True][1])
    np.testing.assert_array_equal(runs[False][2], runs[True][2])
    with pytest.raises(ValueError):
        dh.chain(dh.new_state(4), 3, cp.zeros((1, gpu.model.hp.hidden_size), cp.float32), 0, 5, 3)  # past the cache


def test_verify_rows_and_commit_are_plain_decodes(gpu: Engine, prompts: list[list[int]]) -> None:
    model, prompt = gpu.model, prompts[0]
    parents = [-1, 0, 1, 2, 1, 0, 5, 3, 7, 0]
    tokens = np.random.default_rng(3).integers(0, gpu.vocab_size, len(parents)).tolist()
    state = model.new_state(len(prompt) + 16)
    model.prefill(state, prompt)
    scratch = model.new_tree_scratch(16)
    rows = cp.asnumpy(model.verify_tree(state, scratch, tokens, parents))
    for node in range(len(parents)):
        _, want = plain_decodes(model, prompt, [tokens[n] for n in root_path(parents, node)])
        np.testing.assert_array_equal(rows[node], cp.asnumpy(want), err_msg=f"node {node}")
    path = [0, 1, 2, 3, 7, 8]
    model.commit(state, scratch, path)
    ref, _ = plain_decodes(model, prompt, [tokens[n] for n in path])
    assert_states_equal(state, ref)


def test_decode_after_prefill_equals_a_longer_prefill(gpu: Engine, prompts: list[list[int]]) -> None:
    """On the fallback prefill (decode's arithmetic); the tensor-core prefill is chunk-invariant instead
    (tests/test_cuda_prefill_chunks.py)."""
    model = gpu.model
    with decode_bits_prefill(model):
        _decode_after_prefill_equals_a_longer_prefill(model, prompts)


def _decode_after_prefill_equals_a_longer_prefill(model: Any, prompts: list[list[int]]) -> None:
    for p in prompts:
        ids = (p * 3)[:150]  # crosses prefill piece boundaries (multiples of 64)
        for split in [s for s in (len(ids) - 1, len(ids) - 9, 64) if 1 <= s < len(ids)]:
            state, last = plain_decodes(model, ids[:split], ids[split:])
            full_state = model.new_state(len(ids) + 1)
            full = cp.asnumpy(model.prefill(full_state, ids, all_logits=True))
            assert np.array_equal(cp.asnumpy(last), full[-1]), f"split {split}: decode vs prefill logits"
            assert_states_equal(state, full_state)


def test_decoded_state_equals_a_prefilled_state_at_piece_boundaries(gpu: Engine, prompts: list[list[int]]) -> None:
    """A prompt prefilled to a length on either side of a 64-token piece boundary, then decoded a few tokens across
    the next boundary, leaves exactly the state (every buffer, the KV cache rows included) and logits of one prefill
    of all the tokens: what an exact session cache (prompt prefilled + reply decoded == a cold prefill) relies on.
    The fallback prefill's property (the model then declares ``prefill_matches_decode``)."""
    model = gpu.model
    with decode_bits_prefill(model):
        _decoded_state_equals_a_prefilled_state(model, (prompts[0] * 200)[:200])


def _decoded_state_equals_a_prefilled_state(model: Any, ids: list[int]) -> None:
    for split in (63, 64, 65, 127, 128, 129):
        for end in sorted({split + 2, (split // 64 + 1) * 64 + 1}):  # 2 decodes; decodes across the next boundary
            state, last = plain_decodes(model, ids[:split], ids[split:end])
            full_state = model.new_state(end + 1)
            full = cp.asnumpy(model.prefill(full_state, ids[:end], all_logits=True))
            assert np.array_equal(cp.asnumpy(last), full[-1]), f"prefill {split} + decodes to {end}: logits"
            assert_states_equal(state, full_state)


def test_device_memory_is_flat_over_decode_steps(gpu: Engine, prompts: list[list[int]]) -> None:
    model, pool = gpu.model, cp.get_default_memory_pool()
    state = model.new_state(len(prompts[0]) + 210)
    logits = model.prefill(state, prompts[0])
    logits = model.decode(state, int(cp.argmax(logits)))
    model.synchronize()
    first = pool.used_bytes()
    for _ in range(200):
        logits = model.decode(state, int(cp.argmax(logits)))
    model.synchronize()
    grown = pool.used_bytes() - first
    record("cuda_engine_memory", used_bytes_after_first=first, growth_bytes_200_steps=grown)
    assert grown <= 64 * 1024, f"device memory grew by {grown} bytes over 200 decode steps"


def test_calibrate_measures_the_gpu(gpu: Engine) -> None:
    from tandem.speculative.calibrate import measure_curve

    points = measure_curve(gpu.model, max_nodes=8, context_tokens=64, repeats=1)
    assert [n for n, _ in points] == [1, 2, 3, 4, 6, 8] and all(ms > 0 for _, ms in points)
    assert gpu.model.profile_device.startswith("cuda-")


def test_replayed_verify_equals_a_recorded_one(gpu: Engine, prompts: list[list[int]]) -> None:
    """Verify plans: a second tree of the same size on the same state replays the first one's launches (new
    tokens, parents and position uploaded); its rows equal those of a fresh state that records that tree."""
    model, prompt = gpu.model, prompts[1]
    rng = np.random.default_rng(11)
    trees = [[-1, 0, 1, 2, 1, 0, 5, 3], [-1, 0, 0, 1, 1, 2, 2, 6]]
    tokens = [rng.integers(0, gpu.vocab_size, 8).tolist() for _ in trees]
    state = model.new_state(len(prompt) + 32)
    model.prefill(state, prompt)
    scratch = model.new_tree_scratch(8)
    model.verify_tree(state, scratch, tokens[0], trees[0])
    model.commit(state, scratch, [0, 1])  # move the position: the replay must follow it
    replayed = cp.asnumpy(model.verify_tree(state, scratch, tokens[1], trees[1]))
    fresh_state = model.new_state(len(prompt) + 32)
    model.prefill(fresh_state, prompt)
    for t in tokens[0][:2]:
        model.decode(fresh_state, t)
    fresh = cp.asnumpy(model.verify_tree(fresh_state, model.new_tree_scratch(8), tokens[1], trees[1]))
    np.testing.assert_array_equal(replayed, fresh)
    assert len(state.verify_plans) == 1


def test_pdl_replay_has_the_plain_replay_bits(gpu: Engine, prompts: list[list[int]]) -> None:
    """Replayed decode and verify launches with programmatic dependent launch (plan.py, cuda/common.cuh pdl_wait)
    give the same logits, bit for bit, as the same replays with plain launches, over 24 decode steps and a tree."""
    from tandem.backend.cuda import plan

    model, prompt = gpu.model, prompts[2]
    parents = [-1, 0, 1, 2, 1, 0, 5, 3]
    tokens = np.random.default_rng(5).integers(0, gpu.vocab_size, len(parents)).tolist()

    def run() -> tuple[list[np.ndarray], np.ndarray]:
        state = model.new_state(len(prompt) + 40)
        logits = model.prefill(state, prompt)
        steps = []
        for _ in range(24):
            logits = model.decode(state, int(cp.argmax(logits)))
            steps.append(cp.asnumpy(logits).copy())
        scratch = model.new_tree_scratch(8)
        model.verify_tree(state, scratch, tokens, parents)  # records
        model.commit(state, scratch, [0])
        rows = cp.asnumpy(model.verify_tree(state, scratch, tokens, parents))  # replays
        return steps, rows

    saved = plan.use_pdl
    try:
        plan.use_pdl = False
        plain_steps, plain_rows = run()
        plan.use_pdl = True
        assert plan.pdl_launcher() is not None, "this GPU should take programmatic dependent launch (sm_90+)"
        pdl_steps, pdl_rows = run()
    finally:
        plan.use_pdl = saved
    for i, (a, b) in enumerate(zip(plain_steps, pdl_steps)):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=f"decode step {i}")
    np.testing.assert_array_equal(plain_rows.view(np.uint32), pdl_rows.view(np.uint32))


def test_run_ahead_equals_the_step_loop(gpu: Engine, prompts: list[list[int]]) -> None:
    """Plain rounds run one step ahead on the GPU (engine._run_ahead: the embedding reads the previous step's
    argmax or sampled id on the device, the host reads each id a step later): the same tokens, text and finish as
    the loop that reads every id first (``run_ahead = False``, penalties and sampling on the host): to the budget,
    at an eos, at a stop string, greedy and sampled, with penalties (counted on the device)."""
    assert gpu.run_ahead
    for p in prompts[:4]:
        base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        gpu.run_ahead = False
        try:
            want = gpu.complete(p, base)
        finally:
            gpu.run_ahead = True
        got = gpu.complete(p, base)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert len(gpu.last_stats.rounds) == len(got.token_ids) - 1
        eos = want.token_ids[len(want.token_ids) // 2]
        k = want.token_ids.index(eos)
        cases = [SamplingParams(temperature=0.0, max_tokens=1), SamplingParams(temperature=0.0, max_tokens=2),
                 SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[eos]), SAMPLED,
                 SamplingParams(temperature=1.1, top_k=30, min_p=0.02, seed=77, max_tokens=40, stop_token_ids=[eos]),
                 SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.8),
                 SamplingParams(temperature=0.7, top_p=0.95, frequency_penalty=0.6, seed=5, max_tokens=40)]
        if want.text[-6:-2].strip():
            cases.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[want.text[-6:-2]]))
        for params in cases:
            got = gpu.complete(p, params)
            gpu.run_ahead = False
            try:
                ref = gpu.complete(p, params)
            finally:
                gpu.run_ahead = True
            assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        assert gpu.complete(p, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[eos])).token_ids == \
            want.token_ids[:k + 1]


def test_decode_of_a_pending_token(gpu: Engine, prompts: list[list[int]]) -> None:
    """model.decode of a PendingToken: the latest id read on the device, an older one (its slot no longer on the
    device) by its host value; both give the logits of decoding the id by value, bit for bit."""
    model, prompt = gpu.model, prompts[3]
    a, b = model.new_state(len(prompt) + 8), model.new_state(len(prompt) + 8)
    la, lb = model.prefill(a, prompt), model.prefill(b, prompt)
    for _ in range(3):
        pending = model.choose_on_device(a, la)
        la = model.decode(a, pending)
        lb = model.decode(b, pending.get())
        np.testing.assert_array_equal(cp.asnumpy(la), cp.asnumpy(lb))
    old = model.choose_on_device(a, la)
    newer = model.choose_on_device(a, la)
    assert not old.latest and newer.latest and old.get() == newer.get()
    np.testing.assert_array_equal(cp.asnumpy(model.decode(a, old)), cp.asnumpy(model.decode(b, newer.get())))
    model.choose_on_device(a, la)
    with pytest.raises(RuntimeError, match="overwritten"):
        model.choose_on_device(a, la).reader.read(old.index)


def test_planned_decode_equals_the_launchers_across_chunks(gpu: Engine, prompts: list[list[int]]) -> None:
    """A replayed decode plan (its embedding and attention layers as prebuilt-argument calls whose position and
    grid follow the step: embed.EmbedNormStep, attention_decode.DecodeStep) gives the launchers' logits bit for bit
    at every step of a run from position 40 to 170, across attention chunk boundaries (64, 128) and head-split
    changes; the states end equal too."""
    model, prompt = gpu.model, prompts[0][:40]
    assert model._plannable()

    def run(plannable: bool) -> tuple[list[np.ndarray], Any]:
        model._plannable_cache = plannable
        try:
            state = model.new_state(200)
            logits = model.prefill(state, prompt)
            steps = []
            for _ in range(130):
                logits = model.decode(state, int(cp.argmax(logits)))
                steps.append(cp.asnumpy(logits).copy())
            return steps, state
        finally:
            model._plannable_cache = None

    before = model.plan_recordings
    planned, s1 = run(True)
    assert s1.decode_plan is not None
    assert model.plan_recordings == before + 1  # one recording (the first step), 129 replays
    plain, s2 = run(False)
    assert model.plan_recordings == before + 1
    for i, (a, b) in enumerate(zip(planned, plain)):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=f"decode step {i}")
    assert_states_equal(s1, s2)


def test_replayed_verifies_equal_the_launchers_across_chunks(gpu: Engine, prompts: list[list[int]]) -> None:
    """A verify plan replayed at committed lengths 56 ... 140 (its attention layers as TreeStep calls: the chunk
    grid and the shared partials follow the position) gives the launchers' rows bit for bit at each length; the
    commits between them (paths of 1-5 nodes, different paths of one length: commit plans replayed with the path
    rewritten, their attention rows copied by CommitStep calls at the state's length) leave the state the unplanned
    commits leave; a path with a negative id is refused."""
    model, prompt = gpu.model, prompts[0][:56]
    parents = [-1, 0, 1, 2, 1, 0, 5, 3]
    rng = np.random.default_rng(21)
    planned_state, plain_state = model.new_state(200), model.new_state(200)
    model.prefill(planned_state, prompt)
    model.prefill(plain_state, prompt)
    scratch, plain_scratch = model.new_tree_scratch(8), model.new_tree_scratch(8)
    rounds = 0
    while planned_state.length < 141:
        tokens = rng.integers(0, gpu.vocab_size, len(parents)).tolist()
        path = PATHS[rounds % len(PATHS)]
        got = cp.asnumpy(model.verify_tree(planned_state, scratch, tokens, parents))
        model._plannable_cache = False
        try:
            want = cp.asnumpy(model.verify_tree(plain_state, plain_scratch, tokens, parents))
            model.commit(plain_state, plain_scratch, path)
        finally:
            model._plannable_cache = None
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                      err_msg=f"verify at {planned_state.length}")
        model.commit(planned_state, scratch, path)
        assert_states_equal(planned_state, plain_state)
        rounds += 1
    assert len(planned_state.verify_plans) == 1 and len(planned_state.commit_plans) == 5  # lengths 1-5
    assert not plain_state.commit_plans
    with pytest.raises(ValueError, match="chain"):  # a negative id aliasing a node: refused before any launch
        model.verify_tree(planned_state, scratch, tokens, parents)
        model.commit(planned_state, scratch, [0, -1])
    assert_states_equal(planned_state, plain_state)


# root-to-node chains of [-1, 0, 1, 2, 1, 0, 5, 3]: paths of one length differ from round to round
PATHS = [[0], [0, 5], [0, 1, 4], [0, 1, 2, 3], [0, 1], [0, 5, 6], [0, 1, 2], [0, 1, 2, 3, 7]]
