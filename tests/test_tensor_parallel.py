"""Tensor parallelism on the CPU (tandem/parallel): the layout, the sharded loading and a NumPy mesh of simulated
ranks. One rank gives the unsplit model's bits; two ranks give its tokens (greedy and seeded sampling) with every
reduction in rank order; each rank reads only its slices (row slices are views of the memory map); a slice off a
format's block grid is a clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from device_helpers import assert_states_equal, root_path
from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.config import ConfigError, read_config
from tandem.engine import Engine
from tandem.models.qwen3_5.hparams import HParams
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.qwen3_5.weights import load_mlp
from tandem.parallel.checkpoint import ShardedCheckpoint
from tandem.parallel.numpy_mesh import NumpyMeshModel, exact_sum
from tandem.parallel.plan import ShardPlan
from tandem.sampling import SamplingParams
from tools.make_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tp"), num_hidden_layers=4, full_attention_interval=2,
                            init_std=0.1, seed=3, num_shards=2)


def hparams(path: Path) -> HParams:
    return HParams.from_config(read_config(path))


def test_plan_divides_heads_mlp_and_vocabulary(ckpt: Path) -> None:
    hp = hparams(ckpt)
    rank = ShardPlan(hp, 2).rank_hparams()
    assert (rank.num_attention_heads, rank.num_key_value_heads) == (hp.num_attention_heads // 2,
                                                                   hp.num_key_value_heads // 2)
    assert (rank.linear_num_key_heads, rank.linear_num_value_heads) == (hp.linear_num_key_heads // 2,
                                                                        hp.linear_num_value_heads // 2)
    assert (rank.intermediate_size, rank.vocab_size) == (hp.intermediate_size // 2, hp.vocab_size // 2)
    assert rank.conv_dim == hp.conv_dim // 2 and rank.head_dim == hp.head_dim
    with pytest.raises(ConfigError, match="does not divide num_key_value_heads"):
        ShardPlan(hp, 4)  # 2 KV heads
    with pytest.raises(ConfigError, match="at least 1"):
        ShardPlan(hp, 0)
    plan = ShardPlan(hp, 2)
    p = "model.language_model.layers.0."
    kd, vd = hp.key_dim, hp.value_dim
    qkv = plan.split(p + "linear_attn.in_proj_qkv.weight")
    assert qkv is not None and qkv.axis == 0
    assert qkv.ranges[1] == ((kd // 2, kd), (kd + kd // 2, 2 * kd), (2 * kd + vd // 2, 2 * kd + vd))
    out = plan.split(p + "linear_attn.out_proj.weight")
    assert out is not None and out.axis == 1 and out.ranges[0] == ((0, vd // 2),)
    for whole in ("linear_attn.norm.weight", "input_layernorm.weight", "self_attn.q_norm.weight"):
        assert plan.split(p + whole) is None


@pytest.mark.parametrize("n", [1, 2])
def test_each_rank_reads_its_slice_of_every_tensor(ckpt: Path, n: int) -> None:
    base = Checkpoint.open(ckpt)
    plan = ShardPlan(hparams(ckpt), n)
    views = [ShardedCheckpoint(base, plan, r) for r in range(n)]
    for name in base.text_names():
        full = np.asarray(base.raw(name))
        split = plan.split(name)
        pieces = [np.asarray(v.raw(name)) for v in views]
        for v, piece in zip(views, pieces):
            assert v.shape(name) == piece.shape, name
        if split is None:
            assert all(np.array_equal(piece, full) for piece in pieces), name
            continue
        for r, piece in enumerate(pieces):  # the rank's intervals of the full tensor, in order
            want = np.concatenate([np.take(full, np.arange(a, b), axis=split.axis) for a, b in split.ranges[r]],
                                  axis=split.axis)
            assert np.array_equal(piece, want), f"{name} rank {r}"
            if split.axis == 0 and len(split.ranges[r]) == 1:
                assert np.shares_memory(piece, base.raw(name)), f"{name}: a row slice is read from the mapping"
        assert sum(piece.size for piece in pieces) == full.size, name


def test_fp8_block_scales_follow_their_rows_and_columns(tmp_path: Path) -> None:
    """FP8 block-scaled weights (128 x 128 scale blocks) split on the block grid: each rank's dequantized weight is
    the full weight's slice bit for bit; a grid the split cuts through is refused, naming the tensor."""
    path = write_checkpoint(tmp_path / "fp8", hidden_size=128, num_hidden_layers=2, full_attention_interval=2,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                            linear_value_head_dim=128, fp8=True, seed=5, num_shards=1)
    hp = hparams(path)
    full = Qwen3_5Model.load(path)
    plan = ShardPlan(hp, 2)
    base = Checkpoint.open(path)
    rank_hp = plan.rank_hparams()
    p = "model.language_model.layers.0."
    f = hp.intermediate_size // 2
    for r in range(2):
        mlp = load_mlp(ShardedCheckpoint(base, plan, r), p, rank_hp)
        lw = full.weights.layers[0].mlp
        assert np.array_equal(_dense(mlp.gate), _dense(lw.gate)[r * f:(r + 1) * f])
        assert np.array_equal(_dense(mlp.down), _dense(lw.down)[:, r * f:(r + 1) * f])
    tiny = write_checkpoint(tmp_path / "tiny", num_hidden_layers=2, full_attention_interval=2, fp8=True, seed=5,
                            num_shards=1)
    with pytest.raises(CheckpointError, match="block grid"):
        NumpyMeshModel.load(tiny, 2)


def _dense(lin: object) -> np.ndarray:
    """The dequantized float32 weight [out, in] of a DenseLinear / FP8BlockLinear."""
    return np.asarray(lin.weight)  # type: ignore[attr-defined]


def test_exact_sum_adds_in_rank_order() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(1000).astype(np.float32) * 10.0 ** k for k in (0, 6, -6)]
    want = (parts[0] + parts[1]) + parts[2]
    assert np.array_equal(exact_sum(parts).view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError):
        exact_sum([])


def test_one_rank_gives_the_unsplit_bits(ckpt: Path) -> None:
    one, mesh = Qwen3_5Model.load(ckpt), NumpyMeshModel.load(ckpt, 1)
    ids = np.random.default_rng(1).integers(0, 512, 150).tolist()
    s1, s2 = one.new_state(200), mesh.new_state(200)
    a, b = one.prefill(s1, ids, all_logits=True), mesh.prefill(s2, ids, all_logits=True)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    for t in (5, 77, 300):
        assert np.array_equal(one.decode(s1, t).view(np.uint32), mesh.decode(s2, t).view(np.uint32))
    for spec in s1.specs:
        assert np.array_equal(s1.buffers[spec.name], s2.ranks[0].buffers[spec.name]), spec.name


def _engine(model: object, path: Path) -> Engine:
    hp = hparams(path)
    return Engine(model, None, None, 1024, list(hp.eos_token_ids), "tp", "off", None, 64)  # type: ignore[arg-type]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_two_ranks_give_the_one_rank_tokens(ckpt: Path, params: SamplingParams) -> None:
    one, mesh = Qwen3_5Model.load(ckpt), NumpyMeshModel.load(ckpt, 2)
    for seed in (2, 3):
        ids = np.random.default_rng(seed).integers(0, 512, 130).tolist()
        want = _engine(one, ckpt).complete(ids, params).token_ids
        got = _engine(mesh, ckpt).complete(ids, params).token_ids
        assert got == want, f"prompt seed {seed}"
    # the logits are the unsplit model's within float32 rounding of the row-parallel sums
    ids = np.random.default_rng(4).integers(0, 512, 100).tolist()
    a = one.prefill(one.new_state(128), ids, all_logits=True)
    b = mesh.prefill(mesh.new_state(128), ids, all_logits=True)
    assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a)), float(np.max(np.abs(a - b)))
    assert (np.argmax(a, axis=-1) == np.argmax(b, axis=-1)).all()


def test_engine_and_cli_take_tensor_parallel(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``Engine.from_pretrained(tensor_parallel=2)`` on the CPU is the NumPy mesh with the KV storage asked for and
    lookup speculation, the one-rank engine's tokens; ``tandem generate --tensor-parallel 2`` prints the same ids
    as without."""
    from tandem.cli import main

    ids = np.random.default_rng(7).integers(0, 512, 90).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = Engine.from_pretrained(ckpt, device="cpu", cache="off")
    two = Engine.from_pretrained(ckpt, device="cpu", tensor_parallel=2, spec="lookup", kv_dtype="fp32")
    assert isinstance(two.model, NumpyMeshModel) and two.model.plan.n == 2
    assert two.model.kv_dtype == "float32" and all(r.kv_dtype == "float32" for r in two.model.ranks)
    assert two.speculator is not None and two.cache is not None
    assert two.complete(ids, params).token_ids == one.complete(ids, params).token_ids
    bf16 = Engine.from_pretrained(ckpt, device="cpu", tensor_parallel=2, cache="off")
    assert bf16.model.kv_dtype == "bfloat16"  # the engine's default storage reaches every rank
    outs = []
    for extra in ([], ["--tensor-parallel", "2"]):
        assert main(["generate", str(ckpt), "--device", "cpu", "--prompt-ids", ",".join(map(str, ids[:40])),
                     "--max-tokens", "12", "--ignore-eos", "--json", *extra]) == 0
        outs.append(orjson.loads(capsys.readouterr().out)["output_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 12


def test_tensor_parallel_refusals(ckpt: Path, tmp_path: Path) -> None:
    """Each refusal is one clear error: a size the heads do not divide, a size below one, an adapter without a
    layout (MoE), the MTP drafter (the mesh has no MTP head)."""
    from tools.make_moe_checkpoint import write_moe_checkpoint

    with pytest.raises(ConfigError, match="does not divide num_key_value_heads"):
        Engine.from_pretrained(ckpt, device="cpu", tensor_parallel=4, cache="off")
    for bad in (0, -1, "2", None, 2.0, True):
        with pytest.raises(ValueError, match="must be an integer of at least 1"):
            Engine.from_pretrained(ckpt, device="cpu", tensor_parallel=bad, cache="off")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt lookup only"):
        Engine.from_pretrained(ckpt, device="cpu", tensor_parallel=2, cache="off", spec="mtp")
    moe = write_moe_checkpoint(tmp_path / "moe", seed=1)
    with pytest.raises(ValueError, match="Qwen3_5MoeModel adapter has no tensor-parallel layout"):
        Engine.from_pretrained(moe, device="cpu", tensor_parallel=2, cache="off")


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_mesh_verify_rows_and_commit_are_its_plain_decodes(ckpt: Path, kv: str) -> None:
    """The mesh's tree verify: row i has the bits of the mesh decoding node i after its path; commit leaves every
    rank's state equal to decoding the path token by token, bit for bit."""
    mesh = NumpyMeshModel.load(ckpt, 2)
    mesh.kv_dtype = kv
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 512, 61).tolist()  # the tree crosses the GDN piece boundary at 64
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
        assert np.array_equal(got[node].view(np.uint32), want.view(np.uint32)), f"node {node}"
    path = root_path(parents, 6)
    mesh.commit(state, scratch, path)
    ref = mesh.new_state(96)
    mesh.prefill(ref, ids + [tokens[m] for m in path])
    assert state.length == len(ids) + len(path)
    assert_states_equal(state, ref)  # every rank's buffers (the mesh state's rank-named ones)
    with pytest.raises(ValueError, match="differs from the verified tree's start"):
        mesh.commit(state, scratch, [0])


def test_mesh_speculation_gives_the_one_rank_tokens(ckpt: Path) -> None:
    """Speculation above the mesh (oracle drafts with noise and siblings, every node verified; prompt lookup):
    the one-rank engine's plain tokens, greedy and seeded, with drafted tokens accepted."""
    from spec_helpers import OracleDrafter, speculating
    from tandem.speculative.lookup import LookupDrafter

    one, mesh = Qwen3_5Model.load(ckpt), NumpyMeshModel.load(ckpt, 2)
    rng = np.random.default_rng(12)
    prompt = rng.integers(0, 512, 30).tolist()
    prompt = prompt + prompt[:20]  # something for prompt lookup to find
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=40, ignore_eos=True)):
        want = _engine(one, ckpt).complete(prompt, params).token_ids
        plain_mesh = _engine(mesh, ckpt)
        oracle = speculating(plain_mesh, [OracleDrafter({tuple(prompt): want}, 512, depth=6, corrupt=0.3,
                                                        siblings=1, seed=1)], max_nodes=16)
        out = oracle.complete(prompt, params)
        assert out.token_ids == want
        assert oracle.last_stats.tokens_per_round > 1.5  # drafted tokens were accepted
        assert speculating(plain_mesh, [LookupDrafter()]).complete(prompt, params).token_ids == want


def test_prefix_cache_over_the_mesh(ckpt: Path, tmp_path: Path) -> None:
    """The prefix cache over the mesh's states (every rank's buffers as one state's): a turn that extends a cached
    conversation, and the same turn from the disk tier on a fresh engine, equal a cache-off mesh engine's tokens and
    logprobs bit for bit; the mesh's cache files are not a one-rank engine's (a different state signature)."""
    rng = np.random.default_rng(21)
    first = rng.integers(0, 512, 300).tolist()
    turn = first + rng.integers(0, 512, 40).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(device="cpu", tensor_parallel=2, prefix_chunk=128, cache_dir=tmp_path / "c")
    off = Engine.from_pretrained(ckpt, device="cpu", tensor_parallel=2, cache="off")
    want = off.complete(turn, params)
    warm = Engine.from_pretrained(ckpt, **kw)  # type: ignore[arg-type]
    warm.complete(first, params)
    got = warm.complete(turn, params)
    assert warm.last_cached_tokens >= 256
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert warm.cache is not None and warm.cache.wait_writes(30.0)
    fresh = Engine.from_pretrained(ckpt, **kw)  # type: ignore[arg-type]
    again = fresh.complete(turn, params)
    assert fresh.last_cached_tokens >= 256, "the disk tier serves a restarted engine"
    assert again.token_ids == want.token_ids and again.logprobs == want.logprobs
    one = Engine.from_pretrained(ckpt, device="cpu", prefix_chunk=128, cache_dir=tmp_path / "c")
    one.complete(turn, params)
    assert one.last_cached_tokens == 0, "a one-rank engine does not read the mesh's files"
