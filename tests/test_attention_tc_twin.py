"""The NumPy twin of the tensor-core decode / verify attention (attention_tc.reference_tc_decode; CPU, runs in CI):
within 1e-5 of float64 attention over the same stored bf16 rows at 1k and 8k keys (q and the weights split into
bf16 hi + lo keep ~2^-17 of each), where bf16 q and weights alone miss by ~1e-3; a row's result depends on its own
query only (rows of one KV head computed alone or together give the same bits); the bf16 split is exact in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from tandem.backend.cuda import attention_tc as tc
from tandem.backend.cuda.checks import max_rel_error, rel_error
from tandem.dtypes import bf16_to_f32, f32_to_bf16


def _f64_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    h, d = q.shape
    g = h // keys.shape[1]
    out = np.empty((h, d))
    for i in range(h):
        k, v = keys[:, i // g].astype(np.float64), values[:, i // g].astype(np.float64)
        s = k @ q[i].astype(np.float64) / np.sqrt(d)
        w = np.exp(s - s.max())
        out[i] = w @ v / w.sum()
    return out


def _rows(rng: np.random.Generator, s: int, hkv: int, d: int) -> np.ndarray:
    return bf16_to_f32(f32_to_bf16(rng.standard_normal((s, hkv, d)).astype(np.float32)))


@pytest.mark.parametrize("s", [1, 63, 1024, 8193])
def test_twin_matches_float64(s: int) -> None:
    rng = np.random.default_rng(s)
    h, hkv, d = 24, 4, 256
    q = (2.0 * rng.standard_normal((h, d))).astype(np.float32)  # scores of a few units: a peaked softmax
    keys, values = _rows(rng, s, hkv, d), _rows(rng, s, hkv, d)
    want = _f64_attention(q, keys, values)
    got = tc.reference_tc_decode(q, keys, values)
    assert rel_error(got, want) <= 1e-5 and max_rel_error(got, want) <= 1e-5, \
        f"S={s}: rel {rel_error(got, want):.3g} max {max_rel_error(got, want):.3g}"


def test_the_lo_parts_matter() -> None:
    """Without the lo rows (q and weights in bf16 only) the same attention misses float64 by far more: the split is
    what keeps the path near fp32."""
    rng = np.random.default_rng(7)
    h, hkv, d, s = 24, 4, 256, 1024
    q = (2.0 * rng.standard_normal((h, d))).astype(np.float32)
    keys, values = _rows(rng, s, hkv, d), _rows(rng, s, hkv, d)
    want = _f64_attention(q, keys, values)
    bf16_only = _f64_attention(tc.split_bf16(q)[0], keys, values)
    assert rel_error(bf16_only, want) > 30 * rel_error(tc.reference_tc_decode(q, keys, values), want)


def test_rows_are_independent() -> None:
    rng = np.random.default_rng(3)
    g, d = 6, 128
    q = rng.standard_normal((g, d)).astype(np.float32)
    k, v = _rows(rng, 40, 1, d)[:, 0], _rows(rng, 40, 1, d)[:, 0]
    scale = np.float32(1.0 / np.sqrt(d))
    m, l, acc = tc.reference_tc_unit(q, k, v, scale)
    for r in range(g):
        m1, l1, acc1 = tc.reference_tc_unit(q[r:r + 1], k, v, scale)
        assert m1[0] == m[r] and l1[0] == l[r] and np.array_equal(acc1[0], acc[r])


def test_split_is_exact() -> None:
    x = np.random.default_rng(5).standard_normal(10000).astype(np.float32) * 100
    hi, lo = tc.split_bf16(x)
    assert np.array_equal(bf16_to_f32(f32_to_bf16(hi)), hi) and np.array_equal(bf16_to_f32(f32_to_bf16(lo)), lo)
    assert np.max(np.abs((hi.astype(np.float64) + lo) - x) / np.abs(x)) <= 2.0 ** -16


def test_grids_cover_every_unit() -> None:
    """decode_grid / tree_grid: every unit of every KV head in exactly one block, for any SM count."""
    for units in (1, 2, 16, 511, 2048):
        for sms in (1, 78, 132):
            per, blocks = tc.decode_grid(4, units, sms)
            assert (blocks - 1) * per < units <= blocks * per
    for start in (0, 63, 64, 1000, 32768):
        for nodes in (1, 5, 16, 32):
            chunks = -(-(start + nodes) // tc.UNIT)
            c0, per, shared, total = tc.tree_grid(start, chunks, nodes, 4, 132)
            groups = -(-nodes // tc.TC_NODES)
            assert c0 == start // 64 and shared == (groups * 4 * -(-c0 // per) if c0 else 0)
            assert total == shared + nodes * 4 * (chunks - c0)


def test_relaunch_argument_indices_match_the_source() -> None:
    """TcDecodeStep / TcTreeStep set arguments by index (plan.Relaunch): the indices match the parameter lists of
    cuda/attention_tc.cu, and the launcher's shared-memory size and constants match the kernel's."""
    import re

    from tandem.backend.cuda.loader import CUDA_DIR

    text = (CUDA_DIR / "attention_tc.cu").read_text()

    def names(macro: str) -> list[str]:
        found = re.search(rf"#define {macro}(.*?)\n\n", text, re.S)
        assert found is not None, macro
        return [re.findall(r"\w+", item)[-1] for item in found.group(1).replace("\\\n", " ").split(",")]

    decode, tree = names("TC_DECODE_PARAMS"), names("TC_TREE_PARAMS")
    assert decode.index("num_rows") == tc.DECODE_NUM_ROWS and decode.index("per") == tc.DECODE_PER
    assert len(decode) == 19 and len(tree) == 18
    assert tree.index("part_acc") == tc.TREE_PARTS and tree.index("start") == tc.TREE_START
    assert tree.index("shared_units") == tc.TREE_SHARED_UNITS and tree.index("per") == tc.TREE_PER
    assert tree.index("shared_blocks") == tc.TREE_SHARED_BLOCKS
    for name, value in (("TC_UNIT", tc.UNIT), ("TC_THREADS", tc.THREADS), ("TC_STAGES", tc.STAGES),
                        ("TC_NODES", tc.TC_NODES), ("TC_SC_LD", tc.SC_LD)):
        assert re.search(rf"#define {name} {value}\b", text), name
    assert "(2 * TC_STAGES * TC_UNIT * (d + 8) + nb * 16 * (d + 8)) * 2 + nb * 8 * TC_SC_LD * 4" in text
    assert tc.tc_smem(256, tc.TC_NODES) + 1024 <= 227 * 1024  # a verify block fits an H100 / H200 block
