"""The CUDA model's glue, checked on the CPU (runs in CI): ``CudaQwen3_5Model`` with CuPy replaced by NumPy and
every kernel by its launcher's NumPy reference (the same functions the CUDA tests compare the kernels with).

What this catches without a GPU: the layer loop, the prefill pieces, the tree verify (per-node GDN state copies,
the attention ``owner`` walk) and the commit replay. Checks: decode follows the host model's argmax; prefill then
decode == one prefill; every verify row == a plain decode of its path, bit for bit; speculative == plain through
the engine. The device MTP head (cuda_mtp.py) follows the host head, and drafts the same
chains. The kernels themselves are tests/test_cuda_*.py's business; tests/test_cuda_engine.py runs this on a GPU.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from spec_helpers import GarbageDrafter, OracleDrafter, speculating
from tandem.backend.cuda import argmax, attention_decode, gdn_step, rms_norm, silu_mul
from tandem.dtypes import bf16_to_f32
from tandem.engine import Engine
from tandem.formats import DenseLinear
from tandem.models import device_state
from tandem.models.qwen3_5 import cuda_layer_ops, cuda_model, cuda_mtp, cuda_scratch
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.sampling import SamplingParams
from tandem.speculative.mtp_drafter import MTPDrafter
from tools.make_checkpoint import write_checkpoint


def _fake_cupy() -> Any:
    """NumPy under CuPy's names (asarray, zeros, empty, asnumpy, concatenate, dtypes)."""
    fake = types.SimpleNamespace(**{n: getattr(np, n) for n in (
        "asarray", "zeros", "empty", "concatenate", "ascontiguousarray", "float32", "uint32", "uint16", "int32")})
    fake.asnumpy = lambda a: np.array(a)
    fake.ndarray = np.ndarray
    fake.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None))
    return fake


@pytest.fixture()
def host_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_cupy()
    for mod in (cuda_model, cuda_layer_ops, cuda_scratch, cuda_mtp, device_state):
        monkeypatch.setattr(mod, "cupy", lambda: fake)
    monkeypatch.setattr(cuda_mtp, "top_k", argmax.reference_top_k)
    monkeypatch.setattr(cuda_model, "profile_key", lambda: "cpu-glue-test")
    # the per-token reference composition (the sequence / tree kernels have their own GPU tests)
    monkeypatch.setattr(cuda_model.CudaQwen3_5Model, "FAST", False)
    monkeypatch.setattr(cuda_model, "to_device_linear", lambda lin, ckpt: lin)

    class Bf16Linear(DenseLinear):
        def __init__(self, bits: np.ndarray) -> None:
            super().__init__(bf16_to_f32(bits), "tied")

    monkeypatch.setattr("tandem.backend.cuda.gemv.CudaDenseLinear", Bf16Linear)

    def with_out(y: np.ndarray, out: Any) -> np.ndarray:
        if out is None:
            return y
        out[...] = y
        return out

    def gdn(mixed: Any, tail: Any, conv_w: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, z: Any, norm_w: Any,
            state: Any, num_k_heads: int, eps: float, out: Any = None) -> Any:
        return with_out(gdn_step.reference(mixed, tail, conv_w, a, b, a_log, dt_bias, z, norm_w, state, num_k_heads,
                                           eps), out)

    def add_norm(x: Any, delta: Any, w: Any, eps: float, out: Any = None) -> Any:
        x += delta
        return rms_norm.reference(x, w, eps)

    monkeypatch.setattr(cuda_layer_ops, "gdn_decode_step", gdn)  # the layer ops (cuda_layer_ops.py) launch them
    monkeypatch.setattr(cuda_layer_ops, "rms_norm", lambda x, w, eps, out=None: rms_norm.reference(x, w, eps))
    monkeypatch.setattr(cuda_layer_ops, "add_rms_norm", add_norm)
    monkeypatch.setattr(cuda_layer_ops, "silu_mul", lambda g, u, out=None: silu_mul.reference(g, u))
    monkeypatch.setattr(cuda_model, "_ROPE", {}, raising=False)

    def attn(qg: Any, k: Any, v: Any, q_norm: Any, k_norm: Any, inv_freq: Any, kc: Any, vc: Any, pos: int,
             eps: float, out: Any = None, rope_shift: int = 0, tensor_cores: bool = False) -> Any:
        rd, theta = cuda_model._ROPE["rd"], cuda_model._ROPE["theta"]  # type: ignore[attr-defined]
        return with_out(attention_decode.reference_step(qg, k, v, q_norm, k_norm, rd, theta, kc, vc, pos, eps,
                                                        rope_shift), out)

    monkeypatch.setattr(cuda_layer_ops, "attention_decode_step", attn)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def ckpt(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    return write_checkpoint(tmp_path_factory.mktemp("glue"), num_hidden_layers=4, full_attention_interval=2,
                            init_std=0.1, seed=5, num_shards=1, tie_word_embeddings=request.param)


def _models(ckpt: Any) -> tuple[Qwen3_5Model, Any]:
    host = Qwen3_5Model.load(ckpt)
    cuda_model._ROPE.update(rd=host.hp.rotary_dim, theta=host.hp.rope_theta)  # type: ignore[attr-defined]
    return host, cuda_model.CudaQwen3_5Model(host)


def test_decode_follows_the_host_model(host_ops: None, ckpt: Any) -> None:
    host, dev = _models(ckpt)
    hs, ds = host.new_state(80), dev.new_state(80)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, host.hp.vocab_size, 70).tolist()  # two prefill pieces
    hl, dl = host.prefill(hs, prompt), dev.prefill(ds, prompt)
    assert ds.length == hs.length == 70
    for _ in range(6):
        np.testing.assert_allclose(dl, hl, rtol=1e-4, atol=1e-4)
        token = int(np.argmax(hl))
        assert token == int(np.argmax(dl))
        hl, dl = host.decode(hs, token), dev.decode(ds, token)


def test_prefill_then_decode_equals_one_prefill(host_ops: None, ckpt: Any) -> None:
    _, dev = _models(ckpt)
    ids = np.random.default_rng(1).integers(0, dev.hp.vocab_size, 40).tolist()
    a, b = dev.new_state(64), dev.new_state(64)
    dev.prefill(a, ids[:30])
    for t in ids[30:-1]:
        dev.decode(a, t)
    hid: list[np.ndarray] = []
    last = dev.decode(a, ids[-1], hidden_out=hid)
    full_hid: list[np.ndarray] = []
    full = dev.prefill(b, ids, all_logits=True, hidden_out=full_hid)
    assert full.shape == (40, dev.hp.vocab_size)
    np.testing.assert_array_equal(last, full[-1])
    np.testing.assert_array_equal(hid[0][0], np.concatenate(full_hid)[-1])


def test_verify_rows_and_commit_equal_plain_decodes(host_ops: None, ckpt: Any) -> None:
    _, dev = _models(ckpt)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, dev.hp.vocab_size, 20).tolist()
    #        0   1  2  3  4  5  6  7  (node 4 and 6 branch off earlier nodes: the owner walk must rewrite rows)
    parents = [-1, 0, 1, 2, 1, 0, 5, 3]
    tokens = rng.integers(0, dev.hp.vocab_size, len(parents)).tolist()
    state = dev.new_state(40)
    dev.prefill(state, prompt)
    scratch = dev.new_tree_scratch(8)
    rows = dev.verify_tree(state, scratch, tokens, parents)
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        ref = dev.new_state(40)
        dev.prefill(ref, prompt)
        for n in reversed(path):
            want = dev.decode(ref, tokens[n])
        np.testing.assert_array_equal(rows[node], want, err_msg=f"node {node}")
    path = [0, 1, 2, 3, 7]
    dev.commit(state, scratch, path)
    ref = dev.new_state(40)
    dev.prefill(ref, prompt)
    for n in path:
        dev.decode(ref, tokens[n])
    assert state.length == ref.length
    for name, buf in ref.buffers.items():
        np.testing.assert_array_equal(state.buffers[name][:ref.length] if name.endswith((".k", ".v")) else
                                      state.buffers[name], buf[:ref.length] if name.endswith((".k", ".v")) else buf,
                                      err_msg=name)


def test_spec_equals_plain_through_the_engine(host_ops: None, ckpt: Any) -> None:
    _, dev = _models(ckpt)
    engine = Engine(dev, None, None, max_context=256)
    prompts = [np.random.default_rng(s).integers(0, dev.hp.vocab_size, 12).tolist() * 2 for s in range(3)]
    for params in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)):
        plain = {tuple(p): engine.complete(p, params).token_ids for p in prompts}
        spec = speculating(engine, [OracleDrafter(plain, dev.hp.vocab_size, depth=5, corrupt=0.3, siblings=1),
                                    GarbageDrafter(dev.hp.vocab_size, 3, "mixed", seed=1)], max_nodes=12)
        for p in prompts:
            assert spec.complete(p, params).token_ids == plain[tuple(p)]


def test_the_device_mtp_head_follows_the_host_head(host_ops: None, ckpt: Any) -> None:
    host, dev = _models(ckpt)
    hh, dh = host.draft_heads(), dev.draft_heads()
    assert isinstance(dh, cuda_mtp.CudaMTPHead) and dev.draft_heads() is dh  # uploaded once
    rng = np.random.default_rng(6)
    toks = rng.integers(0, host.hp.vocab_size, 7).tolist()
    hid = rng.standard_normal((7, host.hp.hidden_size)).astype(np.float32)
    hs, ds = hh.new_state(16), dh.new_state(16)
    np.testing.assert_allclose(dh.forward(ds, toks[:5], hid[:5], 0), hh.forward(hs, toks[:5], hid[:5], 0),
                               rtol=1e-4, atol=1e-5)
    for t in (5, 6):  # single rows take the decode attention
        want, got = hh.forward(hs, [toks[t]], hid[t:t + 1], t), dh.forward(ds, [toks[t]], hid[t:t + 1], t)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dh.logits(got), hh.logits(want), rtol=1e-4, atol=1e-5)
        wi, wp = hh.top_probs(want, 3)
        gi, gp = dh.top_probs(got, 3)
        np.testing.assert_array_equal(gi, wi)
        np.testing.assert_allclose(gp, wp, rtol=1e-4)
    assert ds.length == 7
    np.testing.assert_allclose(ds.buffers["layers.0.k"][:7], hs.buffers["k"][:7], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="outside its cache"):
        dh.forward(ds, toks[:2], hid[:2], 15)
    with pytest.raises(ValueError, match="hidden"):
        dh.forward(ds, toks[:2], hid[:1], 0)
    with pytest.raises(ValueError, match="no token ids"):
        dh.forward(ds, [], hid[:0], 0)
    with pytest.raises(ValueError, match="integers"):
        dh.forward(ds, [1.5], hid[:1], 0)  # type: ignore[list-item]


def test_the_device_mtp_head_drafts_the_host_heads_trees(host_ops: None, ckpt: Any) -> None:
    host, dev = _models(ckpt)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, host.hp.vocab_size, 20).tolist()
    state = host.new_state(40)
    hidden: list[np.ndarray] = []
    host.prefill(state, prompt, hidden_out=hidden)
    h = np.concatenate(hidden)
    frags = []
    for head in (host.draft_heads(), dev.draft_heads()):
        d = MTPDrafter(head, steps=4, branch_ratio=0.0, max_branch=3)  # every step branches
        d.reset(prompt[:15], h[:15], 40)
        d.extend(prompt[15:], h[15:])
        frags.append(d.propose(11, 16, 4))
    assert frags[0].token_ids == frags[1].token_ids and frags[0].parents == frags[1].parents
    assert len(frags[0].token_ids) == 12
    np.testing.assert_allclose(frags[1].confidences, frags[0].confidences, rtol=1e-4)


def test_the_engine_reuses_a_device_state_across_sequences(host_ops: None, ckpt: Any) -> None:
    """A device model's state is allocated for the engine's context, kept when its sequence ends and reset for the
    next (its launch plans stay valid), whatever the next sequence's length; outputs equal a fresh engine's, and
    release_state lets it go (the next sequence allocates again)."""
    _, dev = _models(ckpt)
    assert dev.reuses_states
    engine, fresh = Engine(dev, None, None, max_context=256), Engine(dev, None, None, max_context=256)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, dev.hp.vocab_size, n).tolist() for n in (12, 9, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = engine.complete(prompts[0], params).token_ids
    kept = engine._spare_state
    assert kept is not None and kept.max_len == 256 and kept.length > 0
    second = engine.complete(prompts[1], params).token_ids
    assert second == fresh.complete(prompts[1], params).token_ids
    assert engine._spare_state is kept  # reset and reused
    assert engine.complete(prompts[2], params).token_ids == fresh.complete(prompts[2], params).token_ids
    assert engine._spare_state is kept  # a longer sequence too
    assert engine.complete(prompts[0], params).token_ids == first
    engine.release_state()
    assert engine._spare_state is None
    assert engine.complete(prompts[1], params).token_ids == second
    assert engine._spare_state is not None and engine._spare_state is not kept
    spec = speculating(engine, [OracleDrafter({tuple(prompts[0]): first, tuple(prompts[1]): second},
                                              dev.hp.vocab_size, depth=4, corrupt=0.3)], max_nodes=6)
    for p, want in ((prompts[0], first), (prompts[1], second), (prompts[0], first)):  # speculating on a kept state
        assert spec.complete(p, params).token_ids == want
    assert spec._spare_state is not None
