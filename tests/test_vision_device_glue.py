"""Images in on the CUDA model, its host-side glue checked on the CPU (runs in CI): ``CudaQwen3_5Model`` with CuPy
replaced by NumPy and every kernel by its launcher's NumPy reference, as tests/test_cuda_model_glue.py does, with
the image prefill's launcher (attention_prefill_step with ``mrope``) replaced by vision_mrope.reference_prefill and
the vision tower kept on the host (a random one of the checkpoint's vision config: tests/vision_helpers.py).

What this catches without a GPU: the features placed at the pads of the embedding, the 3-D positions handed to the
attention prefill, the rotary shift of decode and verify after an image (cuda_images.py), the vision side moved to
the device model, the state's rows cleared by a reset. Checks: prefill + decode with an image follow the host model
(same argmax, logits within 1e-4); verify rows after an image equal plain decodes bit for bit and a commit gives
their state; speculative == plain through the engine with an image; the helpers' values. The kernels themselves:
tests/test_cuda_vision_mrope.py, tests/test_cuda_vision.py on a GPU.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from spec_helpers import GarbageDrafter, OracleDrafter, speculating
from tandem.backend.cuda import vision_mrope
from tandem.engine import Engine
from tandem.images import PreparedImage
from tandem.multimodal import expand_pads
from tandem.models.qwen3_5 import cuda_images, cuda_layer_ops, cuda_model
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.qwen3_5.mrope import MultimodalRows
from tandem.models.qwen3_5.vision import VisionTower
from tandem.sampling import SamplingParams
from test_cuda_model_glue import _fake_cupy, host_ops  # noqa: F401  (the fixture, shared)
from tools.make_checkpoint import write_checkpoint
from vision_helpers import random_towers


@pytest.fixture()
def image_ops(host_ops: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_cupy()
    monkeypatch.setattr(cuda_images, "cupy", lambda: fake)
    monkeypatch.setattr(vision_mrope, "cupy", lambda: fake)
    monkeypatch.setattr(VisionTower, "to_device", lambda self: self)  # the tower stays NumPy here
    random_towers(monkeypatch)  # make_checkpoint writes no whole tower

    def prefill(qg: Any, k: Any, v: Any, q_norm: Any, k_norm: Any, inv_freq: Any, kc: Any, vc: Any, start: int,
                eps: float, out: Any = None, *, mrope: Any = None, **_: Any) -> Any:
        assert mrope is not None, "the glue's text prefill runs per token (FAST off)"
        rd, theta = cuda_model._ROPE["rd"], cuda_model._ROPE["theta"]  # type: ignore[attr-defined]
        return vision_mrope.reference_prefill(qg, k, v, q_norm, k_norm, rd, theta, mrope.section, mrope.positions,
                                              kc, vc, start, eps)

    monkeypatch.setattr(cuda_layer_ops, "attention_prefill_step", prefill)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_checkpoint(tmp_path_factory.mktemp("vglue"), num_hidden_layers=4, full_attention_interval=2,
                            init_std=0.1, seed=7, num_shards=1)


def _models(ckpt: Any) -> tuple[Qwen3_5Model, Any]:
    host = Qwen3_5Model.load(ckpt)
    cuda_model._ROPE.update(rd=host.hp.rotary_dim, theta=host.hp.rope_theta)  # type: ignore[attr-defined]
    return host, cuda_model.CudaQwen3_5Model(host)


def _image(host: Qwen3_5Model, grid: tuple[int, int, int], seed: int) -> PreparedImage:
    hp = host.vision.hp
    assert hp is not None
    row = hp.in_channels * hp.temporal_patch_size * hp.patch_size ** 2
    pixels = np.random.default_rng(seed).normal(size=(grid[0] * grid[1] * grid[2], row)).astype(np.float32)
    return PreparedImage(pixels, grid, hp.spatial_merge_size, hashlib.sha256(pixels.tobytes()).hexdigest())


def _prompt(host: Qwen3_5Model, seed: int) -> tuple[list[int], list[PreparedImage]]:
    """Text, an image of 4 × 6 patches (6 pads), text, an image of 8 × 4 (8 pads), text: two images, non-square."""
    hp = host.vision.hp
    assert hp is not None
    rng = np.random.default_rng(seed)
    text = rng.integers(0, hp.image_token_id - 10, 30).tolist()
    start, pad, end = hp.vision_start_token_id, hp.image_token_id, hp.vision_end_token_id
    ids = text[:7] + [start, pad, end] + text[7:19] + [start, pad, end] + text[19:]
    images = [_image(host, (1, 4, 6), seed), _image(host, (1, 8, 4), seed + 1)]
    return expand_pads(ids, images, pad), images


def test_the_device_model_reads_images_as_the_host_does(image_ops: None, ckpt: Any) -> None:
    host, dev = _models(ckpt)
    assert dev.capabilities.vision and dev.image_spec() is not None and dev.vision is not host.vision
    ids, images = _prompt(host, 3)
    hs, ds = host.new_state(80), dev.new_state(80)
    hs.multimodal = host.image_rows(ids, images)
    ds.multimodal = dev.image_rows(ids, images)
    assert ds.multimodal.delta < 0  # the images take fewer positions than tokens
    np.testing.assert_array_equal(ds.multimodal.features, hs.multimodal.features)
    hl, dl = host.prefill(hs, ids), dev.prefill(ds, ids)
    for _ in range(6):
        np.testing.assert_allclose(dl, hl, rtol=1e-4, atol=1e-4)
        token = int(np.argmax(hl))
        assert token == int(np.argmax(dl))
        hl, dl = host.decode(hs, token), dev.decode(ds, token)
    ds.reset()
    assert ds.multimodal is None and ds.length == 0


def test_verify_after_an_image_equals_plain_decodes(image_ops: None, ckpt: Any) -> None:
    host, dev = _models(ckpt)
    ids, images = _prompt(host, 4)
    rows = dev.image_rows(ids, images)
    parents = [-1, 0, 1, 2, 1, 0, 5, 3]
    tokens = np.random.default_rng(5).integers(0, dev.hp.vocab_size, len(parents)).tolist()

    def prefilled() -> Any:
        s = dev.new_state(80)
        s.multimodal = rows
        dev.prefill(s, ids)
        return s

    state = prefilled()
    scratch = dev.new_tree_scratch(8)
    got = dev.verify_tree(state, scratch, tokens, parents)
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        ref = prefilled()
        for n in reversed(path):
            want = dev.decode(ref, tokens[n])
        np.testing.assert_array_equal(got[node], want, err_msg=f"node {node}")
    path = [0, 1, 2, 3, 7]
    dev.commit(state, scratch, path)
    ref = prefilled()
    for n in path:
        dev.decode(ref, tokens[n])
    for name, buf in ref.buffers.items():
        view = name.endswith((".k", ".v"))
        np.testing.assert_array_equal(state.buffers[name][:ref.length] if view else state.buffers[name],
                                      buf[:ref.length] if view else buf, err_msg=name)


def test_spec_equals_plain_with_an_image_through_the_engine(image_ops: None, ckpt: Any) -> None:
    host, dev = _models(ckpt)
    engine = Engine(dev, None, None, max_context=256)
    ids, images = _prompt(host, 6)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = engine.complete(ids, params, images=images).token_ids
    text_only = engine.complete(ids[:7], params).token_ids  # the state kept from the image prompt is reset
    assert text_only == Engine(dev, None, None, max_context=256).complete(ids[:7], params).token_ids
    spec = speculating(engine, [OracleDrafter({tuple(ids): plain}, dev.hp.vocab_size, depth=5, corrupt=0.3,
                                              siblings=1), GarbageDrafter(dev.hp.vocab_size, 3, "mixed", seed=2)],
                       max_nodes=12)
    assert spec.complete(ids, params, images=images).token_ids == plain


def test_the_helpers(image_ops: None) -> None:
    class State:
        multimodal: Any = None

    s = State()
    assert cuda_images.rope_shift(s, 5) == 0 and cuda_images.chunk_mrope(s, 0, 4, (1, 1, 1)) is None
    positions = np.array([[0, 0, 0], [1, 1, 1], [1, 1, 2], [1, 2, 1], [1, 2, 2], [3, 3, 3]])
    s.multimodal = MultimodalRows(positions, -2, np.array([2, 3, 4]), np.ones((3, 4), np.float32))
    assert cuda_images.rope_shift(s, 6) == -2 and cuda_images.rope_shift(s, 9, 4) == -2
    assert cuda_images.rope_shift(s, 5) == -2 and cuda_images.rope_shift(s, 0, 2) == 0
    with pytest.raises(ValueError, match="image rows"):
        cuda_images.rope_shift(s, 2)
    rows = cuda_images.chunk_mrope(s, 4, 4, (1, 1, 1))
    np.testing.assert_array_equal(rows.positions, [[1, 2, 2], [3, 3, 3], [4, 4, 4], [5, 5, 5]])
    x = np.zeros((3, 4), np.float32)
    cuda_images.place_features(x, s, 3)  # rows 3, 4 of the pads fall in indices 3..5
    np.testing.assert_array_equal(x, [[1] * 4, [1] * 4, [0] * 4])


@pytest.mark.parametrize("score_bytes", [1 << 30, 4 * 24 * 2 * 5], ids=["one-block", "5-row-blocks"])
def test_the_gpu_towers_attention_in_numpy(monkeypatch: pytest.MonkeyPatch, score_bytes: int) -> None:
    """vision._attention_device (the GPU tower's batched attention over query blocks) run on NumPy arrays equals the
    host tower's per-head loop within float32 rounding, over two frames of 24 patches."""
    from tandem.models.qwen3_5 import vision

    monkeypatch.setattr(vision, "DEVICE_SCORE_BYTES", score_bytes)
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((48, 2, 16)).astype(np.float32) for _ in range(3))
    got = vision._attention_device(np, q, k, v, 24)
    want = np.empty((48, 2, 16), np.float32)
    for s in range(0, 48, 24):
        for head in range(2):
            scores = (q[s:s + 24, head] @ k[s:s + 24, head].T) * np.float32(16 ** -0.5)
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            want[s:s + 24, head] = (scores / scores.sum(axis=1, keepdims=True)) @ v[s:s + 24, head]
    np.testing.assert_allclose(got, want.reshape(48, 32), rtol=1e-5, atol=1e-6)
