"""CUDA MoE kernels (cuda/moe.cu and cuda/gemv.cu's routed-expert GEMVs) against their NumPy references.

Checks: moe_route == reference_route exactly (the host router's choice, ties to the lower index, NaN logits last;
the shared expert stacked as one more row; weights within 1e-6), the chosen experts' gate|up and down GEMVs for BF16, FP8 block and NVFP4 within 1e-5 of the
float64 reference, each row bit for bit the one-token launch's (a verify row == a decode row) and every NaN-poisoned
output row written, moe_combine within 1e-6 of the reference.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import gemv, moe  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.dtypes import bf16_to_f32, e4m3_to_f32, f32_to_bf16  # noqa: E402
from tandem.formats import dequantize_fp8_block, dequantize_nvfp4  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]


def test_route_matches_the_host_router() -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for rows, experts, k, renorm in ((1, 256, 8, True), (7, 512, 10, True), (16, 64, 4, False), (3, 5, 5, True),
                                     (2, 257, 8, True), (9, 63, 6, False)):
        logits = rng.standard_normal((rows, experts)).astype(np.float32)
        logits[0, 3] = logits[0, 1] = logits[0].max() + 1.0  # a tie at the top: the lower index first
        if rows > 2:
            logits[2, ::3] = 0.25  # many ties
            logits[1, 4] = np.nan  # a NaN entry: chosen last (with a NaN weight), the others as the host's
        gate = rng.standard_normal(rows).astype(np.float32) if experts % 2 else None  # the shared expert stacked
        table, weights = moe.route(cp.asarray(logits), experts, k, renorm,
                                   gate=None if gate is None else cp.asarray(gate))
        ref_table, ref_w = moe.reference_route(logits, k, renorm, gate)
        got_t, got_w = cp.asnumpy(table), cp.asnumpy(weights)
        assert np.array_equal(got_t, ref_table), f"seed={seed} rows={rows} X={experts} k={k}: route table " \
            f"differs at {np.flatnonzero(got_t != ref_table)[:5]}"
        fin = np.isfinite(ref_w)
        assert np.array_equal(np.isnan(got_w), np.isnan(ref_w)), f"seed={seed}: NaN weights differ"
        np.testing.assert_allclose(got_w[fin], ref_w[fin], rtol=1e-6, err_msg=f"seed={seed}")
    record("moe_route", seed=seed)


def test_route_rows_are_independent() -> None:
    """A row's route (experts and weights) is the same alone as among 12 rows."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((12, 128)).astype(np.float32)
    table, weights = (cp.asnumpy(a) for a in moe.route(cp.asarray(logits), 128, 8, True))
    n = 12 * 8
    for t in (0, 5, 11):
        one_t, one_w = (cp.asnumpy(a) for a in moe.route(cp.asarray(logits[t:t + 1]), 128, 8, True))
        rows = table[4 * n + t * 8: 4 * n + t * 8 + 8]
        assert np.array_equal(table[rows], one_t[:8]), f"row {t}: experts differ"
        assert np.array_equal(weights[t * 8:(t + 1) * 8], one_w), f"row {t}: weights differ"


def _experts(fmt: str, experts: int, rows: int, cols: int, rng: np.random.Generator) -> tuple[list, list]:
    """(device Linears, float32 weights) of ``experts`` random [rows, cols] experts in ``fmt``."""
    lins, ws = [], []
    for _ in range(experts):
        if fmt == "bf16":
            bits = f32_to_bf16((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))
            lins.append(gemv.CudaDenseLinear(bits))
            ws.append(bf16_to_f32(bits))
        elif fmt == "fp8":
            codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
            codes = np.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).astype(np.uint8)
            scale = rng.uniform(1e-3, 2e-3, (-(-rows // 128), -(-cols // 128))).astype(np.float32)
            lins.append(gemv.CudaFP8BlockLinear(codes, scale))
            ws.append(dequantize_fp8_block(e4m3_to_f32(codes), scale))
        else:
            packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
            sc = rng.integers(0x28, 0x38, (rows, cols // 16), dtype=np.uint8)
            g = float(rng.uniform(0.5, 2.0))
            lins.append(gemv.CudaNVFP4Linear(packed, sc, g))
            ws.append(dequantize_nvfp4(packed, sc, g))
    return lins, ws


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_expert_gemvs(fmt: str) -> None:
    """gate|up (glu, fp32 out and split out) and down over the route of 6 tokens: within 1e-5 of the reference,
    each row bit for bit the one-token launch's, NaN-poisoned outputs fully written."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    experts, k, hidden, inter, t = 9, 3, 256, 128, 6
    gates, wg = _experts(fmt, experts, inter, hidden, rng)
    ups, wu = _experts(fmt, experts, inter, hidden, rng)
    downs, wd = _experts(fmt, experts, hidden, inter, rng)
    gate_up, down = moe.upload_experts(gates, ups, downs, "test")
    x = rng.standard_normal((t, hidden)).astype(np.float32)
    logits = rng.standard_normal((t, experts)).astype(np.float32)
    logits[:, 2] += 3.0  # every token takes expert 2: one block serves all of them
    table, _ = moe.route(cp.asarray(logits), experts, k, True)
    n = t * k
    xs = moe.gather(cp.asarray(x), table, n, gate_up.prep_kind)
    act = cp.full((n, inter), np.nan, dtype=cp.float32)
    moe.expert_gemv(gate_up, experts, xs, table, t, out=act)
    host_table = cp.asnumpy(table)
    ref = moe.reference_experts([np.concatenate([a, b]) for a, b in zip(wg, wu)], x, host_table, glu=True)
    got = cp.asnumpy(act)
    assert not np.isnan(got).any(), f"seed={seed}: unwritten glu rows"
    err = max_rel_error(got, ref)
    assert err <= 1e-5, f"seed={seed} {fmt} glu: max rel {err:.3g}"
    split = cp.full((n, gemv.PARTS[down.prep_kind], inter), 0xFFFF, dtype=cp.uint16)
    moe.expert_gemv(gate_up, experts, xs, table, t, split=down.prep_kind, out=split)
    assert cp.array_equal(split, gemv.prepare(act, down.prep_kind)), f"seed={seed}: split glu != prepare(glu)"
    y = cp.full((n, hidden), np.nan, dtype=cp.float32)
    moe.expert_gemv(down, experts, split, table, t, out=y)
    ref_d = moe.reference_experts(wd, got, np.concatenate([host_table[:3 * n], np.arange(n, dtype=np.int32),
                                                           host_table[4 * n:]]), glu=False)
    got_d = cp.asnumpy(y)
    assert not np.isnan(got_d).any(), f"seed={seed}: unwritten down rows"
    err_d = max_rel_error(got_d, ref_d)
    assert err_d <= 1e-5, f"seed={seed} {fmt} down: max rel {err_d:.3g}"
    for tok in (0, 4):  # a decode of one token: the same bits for its rows
        one_t, _ = moe.route(cp.asarray(logits[tok:tok + 1]), experts, k, True)
        one_xs = moe.gather(cp.asarray(x[tok:tok + 1]), one_t, k, gate_up.prep_kind)
        one_act = moe.expert_gemv(gate_up, experts, one_xs, one_t, 1, split=down.prep_kind)
        one_y = cp.asnumpy(moe.expert_gemv(down, experts, one_act, one_t, 1))
        rows = host_table[4 * n + tok * k: 4 * n + tok * k + k]
        order = cp.asnumpy(one_t)[4 * k:5 * k]
        assert np.array_equal(got_d[rows], one_y[order]), f"seed={seed} {fmt}: token {tok}'s rows differ from " \
            "its one-token launch"
    record(f"moe_experts_{fmt}", glu_max_rel=err, down_max_rel=err_d, row_invariant=True, seed=seed)


def test_combine() -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    t, experts, k, hidden = 5, 16, 4, 300
    table, weights = moe.route(cp.asarray(rng.standard_normal((t, experts)).astype(np.float32)), experts, k, True)
    y = rng.standard_normal((t * k, hidden)).astype(np.float32)
    shared = rng.standard_normal((t, hidden)).astype(np.float32)
    gate = rng.standard_normal((t, 3)).astype(np.float32)
    out = cp.full((t, hidden), np.nan, dtype=cp.float32)
    gate_d = cp.asarray(gate)[:, 1:]  # a strided device view (row stride 3), as the fused router's gate column
    moe.combine(cp.asarray(y), table, weights, t, k, cp.asarray(shared), gate_d, 3, out=out)
    ref = moe.reference_combine(y, cp.asnumpy(table), cp.asnumpy(weights), k, shared, gate[:, 1])
    got = cp.asnumpy(out)
    assert not np.isnan(got).any(), f"seed={seed}: unwritten"
    err = max_rel_error(got, ref)
    assert err <= 1e-6, f"seed={seed}: max rel {err:.3g}"
    stacked = cp.full((t, hidden), np.nan, dtype=cp.float32)  # the shared expert as the last row of each token
    table2, w2 = moe.route(cp.asarray(rng.standard_normal((t, experts)).astype(np.float32)), experts, k, True,
                           gate=gate_d, gate_stride=3)
    moe.combine(cp.asarray(np.concatenate([y, shared])[:t * (k + 1)]), table2, w2, t, k + 1, None, None, 1,
                out=stacked)
    rows2 = np.concatenate([y, shared])[:t * (k + 1)]
    zeros = np.zeros_like(shared)
    ref2 = moe.reference_combine(rows2, cp.asnumpy(table2), cp.asnumpy(w2), k + 1, zeros, np.full(t, -50.0,
                                                                                                   np.float32))
    got2 = cp.asnumpy(stacked)
    assert not np.isnan(got2).any() and max_rel_error(got2, ref2) <= 1e-6, f"seed={seed}: stacked combine"
    record("moe_combine", max_rel=err, seed=seed)


def test_upload_refuses_experts_without_a_tensor_core_path() -> None:
    rng = np.random.default_rng(0)
    gates, _ = _experts("nvfp4", 2, 32, 64, rng)  # NVFP4 needs in % 128 == 0
    with pytest.raises(ValueError, match="layers.0.mlp.experts: the CUDA MoE experts need"):
        moe.upload_experts(gates, gates, gates, "layers.0.mlp.experts")
