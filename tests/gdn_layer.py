"""One random GDN layer for the GDN kernels' tests (tests/test_cuda_gdn_seq.py, tests/test_cuda_gdn_prefill.py):
host float32 weights and their device copies, a random entry tail and state, random token inputs. Needs CuPy."""

from __future__ import annotations

import cupy as cp
import numpy as np

from tandem.backend.cuda import gdn_seq as gq

Shape = tuple[int, int, int, int, int]  # (Hk, Hv, dk, dv, K)


class Layer:
    """One random GDN layer (host float32 weights, their device copies) and a random entry tail / state."""

    def __init__(self, rng: np.random.Generator, shape: Shape) -> None:
        self.rng, self.shape = rng, shape
        hk, hv, dk, dv, taps = shape
        self.c = 2 * hk * dk + hv * dv
        self.conv_w, self.a_log = self.f32(self.c, taps, scale=0.5), np.log(rng.uniform(1, 16, hv)).astype(np.float32)
        self.dt_bias, self.norm_w = self.f32(hv, scale=0.5), (1.0 + self.f32(dv, scale=0.1)).astype(np.float32)
        self.tail, self.state = self.f32(taps - 1, self.c), self.f32(hv, dk, dv, scale=0.1)
        self.dev = [cp.asarray(x) for x in (self.conv_w, self.a_log, self.dt_bias, self.norm_w)]

    def f32(self, *s: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(s) * scale).astype(np.float32)

    def tokens(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """mixed [n, C], a, b [n, Hv], z [n, Hv·dv]."""
        hv, dv = self.shape[1], self.shape[3]
        return self.f32(n, self.c), self.f32(n, hv), self.f32(n, hv), self.f32(n, hv * dv)

    def nan_rows(self, n: int) -> gq.GDNRows:
        rows = gq.new_rows(n, self.shape[0], self.shape[1], self.shape[2], self.shape[3])
        for r in rows:
            r.fill(np.nan)
        return rows
