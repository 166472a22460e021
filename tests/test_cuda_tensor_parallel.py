"""Tensor parallelism on the GPU (tandem/parallel/cuda_mesh.py): one rank computes the single-GPU model's bits, two
ranks the two-rank NumPy mesh's logits within the GPU / CPU tolerance of the single model's parity tests and its
argmax, and the single GPU's tokens (greedy and seeded), for BF16, FP8 block-scaled and NVFP4 weights and either KV
storage. On a one-GPU machine the ranks share the GPU
(``LocalCollective``); NCCL's all-gather runs with one rank there, and the two-GPU test runs where two are found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal, root_path  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.models.qwen3_5.model import Qwen3_5Model  # noqa: E402
from tandem.parallel.collective import LocalCollective, rank_order_sum  # noqa: E402
from tandem.parallel.cuda_mesh import CudaMeshModel  # noqa: E402
from tandem.parallel.numpy_mesh import NumpyMeshModel, exact_sum  # noqa: E402
from tandem.quant.quantize import quantize_checkpoint  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tools.make_checkpoint import write_checkpoint  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# every split lands on FP8's 128-element and NVFP4's 32-element grids at two ranks
DIMS = dict(hidden_size=128, num_hidden_layers=4, full_attention_interval=2, intermediate_size=512,
            num_attention_heads=4, num_key_value_heads=2, head_dim=128, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128, init_std=0.05,
            num_shards=2)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda_tp")
    bf16 = write_checkpoint(root / "bf16", seed=3, **DIMS)  # type: ignore[arg-type]
    fp8 = write_checkpoint(root / "fp8", seed=4, fp8=True, **DIMS)  # type: ignore[arg-type]
    quantize_checkpoint(bf16, root / "nvfp4", "nvfp4")
    return {"bf16": bf16, "fp8": fp8, "nvfp4": root / "nvfp4"}


def _bits(a: Any) -> np.ndarray:
    return np.asarray(cp.asnumpy(a) if isinstance(a, cp.ndarray) else a, dtype=np.float32).view(np.uint32)


def _run(model: Any, ids: list[int], steps: list[int]) -> list[np.ndarray]:
    """Bits of a prefill's every-row logits, then of each decode step's."""
    state = model.new_state(len(ids) + len(steps) + 4)
    out = [_bits(model.prefill(state, ids, all_logits=True))]
    out += [_bits(model.decode(state, t)) for t in steps]
    return out


def _decode_bits(engine: Engine) -> Engine:
    """A single-GPU engine whose prefill has decode's arithmetic, as the mesh's (its tensor-core prefill rounds
    otherwise, tests/test_cuda_prefill_chunks.py)."""
    engine.model.TC_PREFILL = False
    return engine


def test_rank_order_sum_is_exact_sum() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((3, 100)).astype(np.float32) * 10.0 ** k for k in (0, 6, -6)]
    got = rank_order_sum(LocalCollective(3).all_gather([cp.asarray(p) for p in parts])[0])
    np.testing.assert_array_equal(_bits(got), _bits(exact_sum(parts)))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_cuda_mesh_bits(ckpts: dict[str, Path], fmt: str, kv: str) -> None:
    """One rank: the single-GPU model's bits. Two ranks on the GPU: the two-rank NumPy mesh's logits within the
    GPU / CPU tolerance and its argmax (prefill over a GDN piece boundary, then decode steps)."""
    path = ckpts[fmt]
    rng = np.random.default_rng(5)
    ids, steps = rng.integers(0, 512, 70).tolist(), rng.integers(0, 512, 5).tolist()
    host = Qwen3_5Model.load(path)
    host.kv_dtype = kv
    single = host.on_device("cuda")
    single.TC_PREFILL = False  # the mesh prefills with decode's arithmetic: compare with the same on one GPU
    one = CudaMeshModel.load(path, [0], kv_dtype=kv)
    for a, b in zip(_run(single, ids, steps), _run(one, ids, steps)):
        np.testing.assert_array_equal(a, b)
    ref = NumpyMeshModel.load(path, 2)
    ref.kv_dtype = kv
    two = CudaMeshModel.load(path, [0, 0], kv_dtype=kv)
    for a, b in zip(_run(ref, ids, steps), _run(two, ids, steps)):
        want, got = a.view(np.float32), b.view(np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.max(np.abs(want))))
        assert (np.argmax(got, axis=-1) == np.argmax(want, axis=-1)).all()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=32,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_two_ranks_give_the_single_gpu_tokens(ckpts: dict[str, Path], params: SamplingParams) -> None:
    path = ckpts["nvfp4"]
    single = _decode_bits(Engine.from_pretrained(path, device="cuda", cache="off"))
    mesh = CudaMeshModel.load(path, [0, 0])
    tp = Engine(mesh, None, None, 1024, list(mesh.hp.eos_token_ids), "tp", "off", None, 64)
    for seed in (1, 2):
        ids = np.random.default_rng(seed).integers(0, 512, 100).tolist()
        assert tp.complete(ids, params).token_ids == single.complete(ids, params).token_ids, f"prompt {seed}"


def test_nccl_all_gather_one_rank() -> None:
    """NCCL's all-gather through the collective (one rank: the GPU this machine has)."""
    pytest.importorskip("cupy.cuda.nccl")
    from tandem.parallel.collective import NcclCollective

    coll = NcclCollective([0])
    x = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    (g,) = coll.all_gather([x])
    assert g.shape == (1, 3, 4)
    np.testing.assert_array_equal(cp.asnumpy(g[0]), cp.asnumpy(x))


@pytest.mark.skipif(not gpu_available() or cp.cuda.runtime.getDeviceCount() < 2, reason="needs two GPUs")
def test_two_gpus_give_the_shared_gpu_bits(ckpts: dict[str, Path]) -> None:
    """Ranks on GPUs 0 and 1 through NCCL: the bits of both ranks on one GPU, and the engine of
    ``--tensor-parallel 2`` the single GPU's tokens."""
    path = ckpts["nvfp4"]
    rng = np.random.default_rng(8)
    ids, steps = rng.integers(0, 512, 70).tolist(), rng.integers(0, 512, 5).tolist()
    for a, b in zip(_run(CudaMeshModel.load(path, [0, 0]), ids, steps), _run(CudaMeshModel.load(path, [0, 1]),
                                                                                ids, steps)):
        np.testing.assert_array_equal(a, b)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    single = _decode_bits(Engine.from_pretrained(path, device="cuda", cache="off"))
    tp = Engine.from_pretrained(path, device="cuda", cache="off", tensor_parallel=2)
    assert tp.complete(ids, params).token_ids == single.complete(ids, params).token_ids


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_cuda_mesh_verify_rows_and_commit_are_its_plain_decodes(ckpts: dict[str, Path], fmt: str) -> None:
    """Two ranks on the GPU: tree row i has the bits of the mesh decoding node i after its path; commit leaves
    every rank's state equal to a prefill of the prompt and the path, bit for bit."""
    mesh = CudaMeshModel.load(ckpts[fmt], [0, 0])
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 512, 61).tolist()
    parents = [-1, 0, 1, 1, 0, 4, 5]
    tokens = rng.integers(0, 512, len(parents)).tolist()
    state = mesh.new_state(96)
    mesh.prefill(state, ids)
    scratch = mesh.new_tree_scratch(8)
    got = mesh.verify_tree(state, scratch, tokens, parents)
    for node in range(len(parents)):
        ref = mesh.new_state(96)
        mesh.prefill(ref, ids)
        for t in [tokens[m] for m in root_path(parents, node)]:
            want = mesh.decode(ref, t)
        np.testing.assert_array_equal(_bits(got[node]), _bits(want), err_msg=f"node {node}")
    path = root_path(parents, 6)
    mesh.commit(state, scratch, path)
    ref = mesh.new_state(96)
    mesh.prefill(ref, ids + [tokens[m] for m in path])
    assert_states_equal(state, ref)  # every rank's buffers (the mesh state's rank-named ones)
    np.testing.assert_array_equal(_bits(mesh.decode(state, 7)), _bits(mesh.decode(ref, 7)))


def test_cuda_mesh_speculation_gives_the_single_gpu_tokens(ckpts: dict[str, Path]) -> None:
    """Speculation above the GPU mesh (noisy oracle trees, every node verified; prompt lookup through
    ``Engine.from_pretrained``'s spec) gives the single GPU's plain tokens, greedy and seeded."""
    from spec_helpers import OracleDrafter, speculating

    path = ckpts["nvfp4"]
    single = _decode_bits(Engine.from_pretrained(path, device="cuda", cache="off"))
    mesh = CudaMeshModel.load(path, [0, 0])
    plain = Engine(mesh, None, None, 1024, list(mesh.hp.eos_token_ids), "tp", "off", None, 64)
    lookup = Engine(mesh, None, None, 1024, list(mesh.hp.eos_token_ids), "tp", "lookup", None, 64)
    prompt = np.random.default_rng(12).integers(0, 512, 30).tolist()
    prompt = prompt + prompt[:20]
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=40, ignore_eos=True)):
        want = single.complete(prompt, params).token_ids
        oracle = speculating(plain, [OracleDrafter({tuple(prompt): want}, 512, depth=6, corrupt=0.3, siblings=1,
                                                   seed=1)], max_nodes=16)
        assert oracle.complete(prompt, params).token_ids == want
        assert oracle.last_stats.tokens_per_round > 1.5
        assert lookup.complete(prompt, params).token_ids == want


def test_prefix_cache_over_the_gpu_mesh(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """``Engine.from_pretrained(tensor_parallel=2)`` (both ranks on this GPU) with the prefix cache: a turn that
    extends a cached conversation, and the same turn from the disk tier on a fresh engine, equal a cache-off mesh
    engine's tokens and logprobs bit for bit."""
    path = ckpts["nvfp4"]
    rng = np.random.default_rng(21)
    first = rng.integers(0, 512, 300).tolist()
    turn = first + rng.integers(0, 512, 40).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw: dict[str, Any] = dict(device="cuda", tensor_parallel=2, tensor_parallel_devices=[0, 0], prefix_chunk=128)
    off = Engine.from_pretrained(path, cache="off", **kw)
    assert isinstance(off.model, CudaMeshModel) and off.warm_up() > 0.0  # a device model: its kernels loaded
    want = off.complete(turn, params)
    warm = Engine.from_pretrained(path, cache_dir=tmp_path / "c", **kw)
    warm.complete(first, params)
    got = warm.complete(turn, params)
    assert warm.last_cached_tokens >= 256
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert warm.cache is not None and warm.cache.wait_writes(60.0)
    fresh = Engine.from_pretrained(path, cache_dir=tmp_path / "c", **kw)
    again = fresh.complete(turn, params)
    assert fresh.last_cached_tokens >= 256
    assert again.token_ids == want.token_ids and again.logprobs == want.logprobs


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_planned_decode_is_the_layer_loop(ckpts: dict[str, Path], fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mesh's recorded decode (cuda_mesh.MeshPlan: stages and calls) gives the bits of running the layer loop
    every step, across replays and on a reset state (a new sequence replays the same plan)."""
    from tandem.parallel import cuda_mesh

    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, 512, 50).tolist(), rng.integers(0, 512, 20).tolist()]
    steps = rng.integers(0, 512, 6).tolist()
    runs = []
    for planned in (False, True):
        monkeypatch.setattr(cuda_mesh, "PLANNED", planned)
        mesh = CudaMeshModel.load(ckpts[fmt], [0, 0])
        state = mesh.new_state(96)
        out = []
        for prompt in prompts:
            state.reset()
            mesh.prefill(state, prompt)
            out += [_bits(mesh.decode(state, t)) for t in steps]
        assert (state.decode_plan is not None) == planned
        runs.append(out)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
