"""Host cost of one kernel launch from Python: cupy.RawKernel.__call__ vs cupy.cuda.driver.launchKernel with
arguments bound once (ctypes), on a kernel that does nothing (8 pointer/int arguments, like the engine's).
Usage: python3 bench/launch.py. Prints µs per launch (host wall time over 20,000 launches, synced at the end).
"""

from __future__ import annotations

import ctypes
import time

import cupy as cp
import numpy as np

SRC = r'''
extern "C" __global__ void noop(const float* a, const float* b, float* c, unsigned short* d, int e, int f, int g,
                                float h) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && e < 0) c[0] = a[0] + b[0] + h + f + g + d[0];
}
'''


def main() -> None:
    fn = cp.RawModule(code=SRC).get_function("noop")
    a, b, c = (cp.zeros(16, cp.float32) for _ in range(3))
    d = cp.zeros(16, cp.uint16)
    args = (a, b, c, d, np.int32(1), np.int32(2), np.int32(3), np.float32(0.5))
    n = 20000
    for _ in range(100):
        fn((1,), (32,), args)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn((1,), (32,), args)
    cp.cuda.Device().synchronize()
    raw = (time.perf_counter() - t0) / n * 1e6
    objs = [ctypes.c_void_p(x.data.ptr) for x in (a, b, c, d)] + [ctypes.c_int32(1), ctypes.c_int32(2),
                                                                    ctypes.c_int32(3), ctypes.c_float(0.5)]
    params = (ctypes.c_void_p * len(objs))(*[ctypes.addressof(o) for o in objs])
    launch = cp.cuda.driver.launchKernel
    ptr, pp, stream = fn.kernel.ptr, ctypes.addressof(params), cp.cuda.get_current_stream().ptr
    for _ in range(100):
        launch(ptr, 1, 1, 1, 32, 1, 1, 0, stream, pp, 0)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        launch(ptr, 1, 1, 1, 32, 1, 1, 0, stream, pp, 0)
    cp.cuda.Device().synchronize()
    drv = (time.perf_counter() - t0) / n * 1e6
    print(f"launch overhead: RawKernel.__call__ {raw:.2f} us, driver.launchKernel (bound args) {drv:.2f} us")


if __name__ == "__main__":
    main()
