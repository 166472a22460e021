"""The KV cache's storage, bf16 (the default) or fp32, on the CPU engine (CI): rows rounded to nearest even when
written, widened exactly when read (tandem/backend/kv_rows.py), the storage in the state's buffer specs and so in
its signature and the cache's sizes; tree verify and commit keep decode's bits with bf16 rows; speculative ==
plain and a prefix-cache restore == a fresh engine with bf16 rows; the option on Engine and the CLI.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem.backend.kv_rows import read_rows, round_rows, write_rows
from tandem.cache import arrays
from tandem.cli import build_parser, cache_options
from tandem.dtypes import bf16_to_f32, f32_to_bf16, kv_dtype_name, storage_dtype
from tandem.engine import Engine
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.sampling import SamplingParams
from tools.make_checkpoint import write_checkpoint

from device_helpers import assert_states_equal


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("kv"), init_std=0.1, seed=5)


def test_rows_round_to_nearest_even_and_widen_exactly() -> None:
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -7)  # bf16's spacing at 1
    x = np.array([[one + ulp / 2, one + 3 * ulp / 2, -(one + ulp / 4), np.float32(3e38), np.nan]], np.float32)
    buf = np.full((3, 5), 0xFFFF, np.uint16)
    write_rows(buf, 1, x)
    got = read_rows(buf, 2, start=1)[0]
    assert got[0] == one and got[1] == one + 2 * ulp  # ties to even (down, then up)
    assert got[2] == -one and np.isfinite(got[3]) and np.isnan(got[4])
    assert (buf[0] == 0xFFFF).all() and (buf[2] == 0xFFFF).all(), "rows outside [start, start + T) written"
    assert np.array_equal(buf[1], f32_to_bf16(x[0]))
    assert np.array_equal(round_rows(x, np.dtype(np.uint16)), bf16_to_f32(f32_to_bf16(x)), equal_nan=True)
    f = np.zeros((2, 5), np.float32)
    write_rows(f, 0, x)
    assert np.array_equal(read_rows(f, 1), x, equal_nan=True) and round_rows(x, np.dtype(np.float32)) is x
    with pytest.raises(TypeError, match="float32 or uint16"):
        write_rows(np.zeros((2, 5), np.float16), 0, x)


def test_names_and_storage() -> None:
    assert kv_dtype_name("bf16") == kv_dtype_name("bfloat16") == "bfloat16"
    assert kv_dtype_name("fp32") == kv_dtype_name("float32") == "float32"
    with pytest.raises(ValueError, match="bf16"):
        kv_dtype_name("fp16")
    assert storage_dtype("bfloat16") == np.uint16 and storage_dtype("float32") == np.float32
    assert arrays.spec_rows_nbytes((9, 4, 256), "bfloat16") == 4 * 256 * 2
    assert arrays.spec_rows_nbytes((9, 4, 256), "float32") == 4 * 256 * 4


def test_states_hold_the_storage(ckpt: Path) -> None:
    model = Qwen3_5Model.load(ckpt)
    fp32 = model.new_state(64)
    model.kv_dtype = "bfloat16"
    bf16 = model.new_state(64)
    views = [s.name for s in bf16.specs if s.kind == "view"]
    assert views and all(bf16.buffers[n].dtype == np.uint16 for n in views)
    assert all(fp32.buffers[n].dtype == np.float32 for n in views)
    kv_bytes = sum(int(fp32.buffers[n].nbytes) for n in views)
    assert fp32.nbytes() - bf16.nbytes() == kv_bytes // 2
    assert fp32.signature != bf16.signature
    with pytest.raises(ValueError, match="signature"):
        bf16.copy_from(fp32)


def _decode_all(model: Qwen3_5Model, ids: list[int], extra: list[int]) -> tuple[object, list[np.ndarray]]:
    state = model.new_state(len(ids) + len(extra) + 1)
    model.prefill(state, ids)
    return state, [model.decode(state, t) for t in extra]


def test_bf16_tree_verify_and_commit_are_decodes(ckpt: Path) -> None:
    """With bf16 rows, each verified node's logits equal a plain decode of its path, and a commit leaves the
    decoded state's bits (DESIGN.md, row invariance), for a tree whose branches share cache positions."""
    model = Qwen3_5Model.load(ckpt)
    model.kv_dtype = "bfloat16"
    ids = [3, 17, 42, 5, 9, 11, 2, 30]
    parents = [-1, 0, 1, 0, 3, 2, 4]
    tokens = [12, 7, 19, 8, 25, 33, 4]
    state = model.new_state(32)
    model.prefill(state, ids)
    scratch = model.new_tree_scratch(8)
    logits = model.verify_tree(state, scratch, tokens, parents)
    for node in range(len(tokens)):
        path = []
        m = node
        while m >= 0:
            path.append(m)
            m = parents[m]
        path.reverse()
        _, outs = _decode_all(model, ids, [tokens[p] for p in path])
        assert np.array_equal(logits[node].view(np.uint32), outs[-1].view(np.uint32)), f"node {node}"
    model.commit(state, scratch, [0, 3, 4, 6])
    want, _ = _decode_all(model, ids, [tokens[p] for p in (0, 3, 4, 6)])
    assert_states_equal(state, want)


def test_engine_option_and_spec_equals_plain(ckpt: Path) -> None:
    bf16 = Engine.from_pretrained(ckpt, max_context=256)
    assert bf16.model.kv_dtype == "bfloat16"
    fp32 = Engine.from_pretrained(ckpt, max_context=256, kv_dtype="fp32")
    assert fp32.model.kv_dtype == "float32"
    with pytest.raises(ValueError, match="bf16"):
        Engine.from_pretrained(ckpt, kv_dtype="fp16")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = [5, 9, 5, 9, 5, 9, 14, 2, 5, 9, 5, 9]
    plain = bf16.complete(prompt, params).token_ids
    spec = Engine.from_pretrained(ckpt, max_context=256, spec="lookup").complete(prompt, params).token_ids
    assert spec == plain, "speculative greedy != plain greedy with bf16 KV"
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=7)
    spec_engine = Engine.from_pretrained(ckpt, max_context=256, spec="lookup")
    assert spec_engine.complete(prompt, sampled).token_ids == bf16.complete(prompt, sampled).token_ids


def test_bf16_cache_restore_equals_a_fresh_engine(ckpt: Path) -> None:
    """A request served from the prefix cache (bf16 snapshots) equals the same request on a fresh engine."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(3, 3 + 300))
    warm = Engine.from_pretrained(ckpt, max_context=512, prefix_chunk=64)
    first = warm.complete(prompt, params).token_ids
    again = warm.complete(prompt + [7], params).token_ids
    fresh = Engine.from_pretrained(ckpt, max_context=512, prefix_chunk=64, cache="off")
    assert first == fresh.complete(prompt, params).token_ids
    assert again == fresh.complete(prompt + [7], params).token_ids
    assert warm.cache is not None and warm.cache.stats.snapshots > 0


def test_cli_takes_the_kv_dtype() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--kv-dtype", "fp32"])
    assert cache_options(args)["kv_dtype"] == "fp32"
    assert cache_options(build_parser().parse_args(["generate", "--prompt", "hi"]))["kv_dtype"] is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-dtype", "fp16"])


def test_the_disk_signature_holds_the_kv_dtype(ckpt: Path) -> None:
    """A disk snapshot written with one KV storage is another state layout for an engine of the other."""
    from tandem.cache.build import state_signature

    bf16 = Engine.from_pretrained(ckpt, max_context=64, cache="off")
    fp32 = Engine.from_pretrained(ckpt, max_context=64, cache="off", kv_dtype="fp32")
    assert state_signature(bf16.model) != state_signature(fp32.model)
