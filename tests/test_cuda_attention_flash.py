"""The prefill's flash attention (cuda/attention_flash.cu, tandem/backend/cuda/attention_flash.py) on fresh random
inputs.

Checks: against the float32 NumPy reference (attention_tree.reference_prefill) within a bf16 tolerance (q, K, V and
the softmax weights are bf16 operands: relative error ≤ 1e-2, measured ~3e-3), for fp32 and bf16 KV rows, head sizes
64 / 128 / 256, GQA groups 1-6, chunks that start at 0 or deep in a cache and end off the 64-key tiles; every output
element written (NaN-poisoned y and xs); the "b16" operand equals bf16(y) bit for bit; the K / V rows it writes are
attn_prep_rows' (the cache's dtype); chunk invariance: a prompt's attention rows and cache rows are the same bits
whether its tokens come in one call or in chunks cut anywhere; a 32k-token context against the reference.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import attention_tree as at  # noqa: E402
from tandem.backend.cuda.attention_flash import attention_flash_prefill, reference  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.backend.kv_rows import read_rows  # noqa: E402
from tandem.dtypes import f32_to_bf16  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# (H, Hkv, D, rotary dims): the embedded default model's attention, a 128-dim MHA layer, Qwen3.5-27B's
SHAPES = [(6, 2, 64, 16), (4, 4, 128, 32), (24, 4, 256, 64)]
THETA, EPS = 1e7, 1e-6
TOL = 1e-2


def _inputs(rng: np.random.Generator, shape: tuple[int, int, int, int], rows: int, start: int, max_len: int,
            kv: str) -> dict[str, np.ndarray]:
    h, hkv, d, _ = shape

    def f32(*s: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(s) * scale).astype(np.float32)

    k_cache = np.full((max_len, hkv, d), np.nan, dtype=np.float32)
    v_cache = k_cache.copy()
    k_cache[:start], v_cache[:start] = f32(start, hkv, d), f32(start, hkv, d)
    if kv == "bf16":
        k_cache, v_cache = f32_to_bf16(k_cache), f32_to_bf16(v_cache)
    return {"qg": f32(rows, h, 2 * d), "k_new": f32(rows, hkv, d), "v_new": f32(rows, hkv, d),
            "q_norm": (1.0 + f32(d, scale=0.1)).astype(np.float32),
            "k_norm": (1.0 + f32(d, scale=0.1)).astype(np.float32), "k_cache": k_cache, "v_cache": v_cache}


def _run(x: dict[str, np.ndarray], rd: int, start: int, lo: int, hi: int, caches: tuple[object, object],
         split: str | None = None) -> object:
    dev = {k: cp.asarray(v[lo:hi]) if k in ("qg", "k_new", "v_new") else cp.asarray(v) for k, v in x.items()
           if k not in ("k_cache", "v_cache")}
    h, d = x["qg"].shape[1], x["qg"].shape[2] // 2
    if split is None:
        out = cp.full((hi - lo, h * d), np.nan, dtype=cp.float32)
        return attention_flash_prefill(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"],
                                       cp.asarray(ad.inv_freq(rd, THETA)), caches[0], caches[1], start + lo, EPS,
                                       out=out)
    xs = cp.full((hi - lo, 1, h * d), 0x7FC1, dtype=cp.uint16)
    return attention_flash_prefill(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"],
                                   cp.asarray(ad.inv_freq(rd, THETA)), caches[0], caches[1], start + lo, EPS,
                                   split=split, xs=xs)


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("start,rows", [(0, 1), (0, 100), (0, 256), (37, 64), (700, 130), (3000, 257)])
@pytest.mark.parametrize("shape", SHAPES)
def test_flash_prefill_matches_the_reference(shape: tuple[int, int, int, int], start: int, rows: int,
                                             kv: str) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    rd = shape[3]
    max_len = start + rows + 70
    x = _inputs(rng, shape, rows, start, max_len, kv)
    kc, vc = cp.asarray(x["k_cache"]), cp.asarray(x["v_cache"])
    y = cp.asnumpy(_run(x, rd, start, 0, rows, (kc, vc)))
    assert not np.isnan(y).any(), f"seed {seed}: an output element was not written"
    ref = at.reference_prefill(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], rd, THETA, x["k_cache"],
                               x["v_cache"], start, EPS)
    err = rel_error(y, ref)
    assert err < TOL and max_rel_error(y, ref) < 5 * TOL, f"seed {seed}: rel. error {err:.3g}"
    # against the kernel's own operands (q as attn_prep_rows wrote it, the cache rows): closer still
    q = cp.asnumpy(at._prep(*(cp.asarray(x[n]) for n in ("qg", "k_new", "v_new", "q_norm", "k_norm")),
                            cp.asarray(ad.inv_freq(rd, THETA)), None, cp.empty_like(kc), cp.empty_like(vc), start,
                            start, EPS))
    own = reference(q, read_rows(cp.asnumpy(kc), start + rows), read_rows(cp.asnumpy(vc), start + rows),
                    x["qg"][:, :, shape[2]:], start)
    assert rel_error(y, own) < 4e-3, f"seed {seed}: rel. error {rel_error(y, own):.3g} against its operands"
    # the rows it wrote into the cache (reference_prefill wrote its own into x's caches): V exactly (stored as
    # given, rounded to the cache's dtype), K (normed, rotated) within the storage's rounding
    np.testing.assert_array_equal(cp.asnumpy(vc[start:start + rows]), x["v_cache"][start:start + rows])
    k_got, k_ref = (read_rows(c[:start + rows], start + rows)[start:] for c in (cp.asnumpy(kc), x["k_cache"]))
    assert rel_error(k_got, k_ref) < (1e-2 if kv == "bf16" else 1e-5)
    record("cuda_attention_flash", shape=list(shape), start=start, rows=rows, kv=kv, rel_error=err)


@pytest.mark.parametrize("shape", SHAPES[::2])
def test_b16_operand_is_bf16_of_y(shape: tuple[int, int, int, int]) -> None:
    rng = np.random.default_rng(secrets.randbits(32))
    x = _inputs(rng, shape, 150, 90, 300, "bf16")
    y = cp.asnumpy(_run(x, shape[3], 90, 0, 150, (cp.asarray(x["k_cache"]), cp.asarray(x["v_cache"]))))
    xs = cp.asnumpy(_run(x, shape[3], 90, 0, 150, (cp.asarray(x["k_cache"]), cp.asarray(x["v_cache"])), "b16"))
    np.testing.assert_array_equal(xs[:, 0], f32_to_bf16(y))


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_do_not_depend_on_the_chunks(shape: tuple[int, int, int, int], kv: str) -> None:
    """One call over 300 tokens, and the same tokens in chunks cut at 1, 63, 64, 65, 191, 299: identical y rows and
    cache rows (the key tiles are absolute; the padding of a warp's rows changes, the row's arithmetic does not)."""
    rng = np.random.default_rng(secrets.randbits(32))
    rows, start = 300, 45
    x = _inputs(rng, shape, rows, start, start + rows + 8, kv)
    whole = (cp.asarray(x["k_cache"]), cp.asarray(x["v_cache"]))
    want = cp.asnumpy(_run(x, shape[3], start, 0, rows, whole))
    for cuts in ([1], [63, 64], [65, 191], [299], [17, 100, 228]):
        caches = (cp.asarray(x["k_cache"]), cp.asarray(x["v_cache"]))
        edges = [0, *cuts, rows]
        got = np.concatenate([cp.asnumpy(_run(x, shape[3], start, a, b, caches)) for a, b in zip(edges, edges[1:])])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"cuts {cuts}"
        for got_c, want_c in zip(caches, whole):
            g, w = cp.asnumpy(got_c)[:start + rows], cp.asnumpy(want_c)[:start + rows]
            assert np.array_equal(g.view(np.uint16), w.view(np.uint16)), f"cuts {cuts}: cache rows"


def test_long_context_matches_the_reference() -> None:
    """128 query rows at positions 32,640.. over a 32k-row bf16 cache (the 27B head shape, one KV head's group)."""
    rng = np.random.default_rng(secrets.randbits(32))
    shape = (6, 1, 256, 64)
    start, rows = 32640, 128
    x = _inputs(rng, shape, rows, start, start + rows, "bf16")
    y = cp.asnumpy(_run(x, shape[3], start, 0, rows, (cp.asarray(x["k_cache"]), cp.asarray(x["v_cache"]))))
    ref = at.reference_prefill(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], shape[3], THETA,
                               x["k_cache"], x["v_cache"], start, EPS)
    err = rel_error(y, ref)
    assert err < TOL, f"rel. error {err:.3g} at 32k"
    record("cuda_attention_flash_32k", rel_error=err)


def test_bad_arguments_raise() -> None:
    rng = np.random.default_rng(0)
    x = _inputs(rng, (4, 2, 48, 16), 8, 0, 16, "fp32")  # head size 48: no instance
    with pytest.raises(ValueError):
        _run(x, 16, 0, 0, 8, (cp.asarray(x["k_cache"]), cp.asarray(x["v_cache"])))
    x = _inputs(rng, (4, 2, 64, 16), 8, 0, 8, "fp32")
    with pytest.raises(ValueError):  # past the cache's rows
        _run(x, 16, 4, 0, 8, (cp.asarray(x["k_cache"]), cp.asarray(x["v_cache"])))
