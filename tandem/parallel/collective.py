"""The mesh's one collective: an all-gather of every rank's partial rows, then sums in rank order on every rank.

A row-parallel projection (attention o_proj, GDN out_proj, MLP down_proj) leaves each rank a partial sum; the mesh
all-gathers them (``all_gather``: on every rank an [n, ...] array, part r in row r) and each rank adds the parts
in rank order (``rank_order_sum``: ((p0 + p1) + p2) + ..., float32), so every rank computes the same bits whatever
NCCL's own reduction order, and the bits equal ``numpy_mesh.exact_sum`` of the same parts.

Two implementations: ``NcclCollective`` (one GPU a rank, NCCL's all-gather through ``cupy.cuda.nccl``, one
process driving every device in a group call; NVLink multicast is kept off, ``NCCL_NVLS_ENABLE=0``) and
``LocalCollective`` (every rank on one GPU: the gather is a stack on that device; the tests of the rank arithmetic
on a one-GPU machine, and N = 1). Source: NCCL's API (ncclAllGather, ncclGroupStart / ncclGroupEnd); Shoeybi et al.
2019 (Megatron-LM) §3 for where the reductions fall.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from tandem.backend.cuda.loader import cupy


class Collective(Protocol):
    """The all-gather a mesh of ``n`` ranks runs (one call gathers one array a rank)."""

    n: int
    devices: tuple[int, ...]

    def all_gather(self, parts: Sequence[Any]) -> list[Any]:
        """``parts[r]``: rank r's C-contiguous float32 device array on ``devices[r]`` (every part of one shape).
        Returns, for every rank r, a float32 array [n, *shape] on ``devices[r]`` holding part k in row k.
        Raises: ValueError for a wrong count, shape or dtype of parts."""
        ...


def _check(parts: Sequence[Any], n: int) -> tuple[int, ...]:
    """The parts' common shape. Raises: ValueError (count, shapes or dtypes)."""
    if len(parts) != n:
        raise ValueError(f"all_gather takes one part a rank: {len(parts)} parts for {n} ranks")
    shape = tuple(int(d) for d in parts[0].shape)
    for r, p in enumerate(parts):
        if tuple(int(d) for d in p.shape) != shape or p.dtype != cupy().float32:
            raise ValueError(f"all_gather: part {r} is {p.dtype} {tuple(p.shape)}, expected float32 {shape}")
    return shape


def rank_order_sum(gathered: Any, out: Any = None) -> Any:
    """((g[0] + g[1]) + g[2]) + ... of a gathered [n, ...] float32 device array, on its device: a new array [...],
    or written into ``out`` (the same bits as ``numpy_mesh.exact_sum`` of the same parts)."""
    return sum_parts([gathered[k] for k in range(int(gathered.shape[0]))], out)


def sum_parts(parts: Sequence[Any], out: Any = None) -> Any:
    """((p0 + p1) + p2) + ... of float32 device arrays of one shape on the current device (into ``out`` when
    given): one elementwise launch for two parts, one more a part after."""
    cp = cupy()
    if len(parts) == 1:
        if out is None:
            return parts[0].copy()
        out[...] = parts[0]
        return out
    out = cp.add(parts[0], parts[1], out=out)
    for p in parts[2:]:
        out += p
    return out


class LocalCollective:
    """``n`` ranks on one GPU (``device``): the gather stacks the parts on it (every rank reads the same array).

    Args: n: ranks (≥ 1); device: the CUDA device id they share.
    """

    def __init__(self, n: int, device: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a mesh needs at least one rank, got {n}")
        self.n, self.devices = n, tuple([device] * n)

    def all_gather(self, parts: Sequence[Any]) -> list[Any]:
        """See ``Collective.all_gather``; one stack on the shared device, returned for every rank."""
        _check(parts, self.n)
        cp = cupy()
        with cp.cuda.Device(self.devices[0]):
            gathered = cp.stack(list(parts))
        return [gathered] * self.n


class NcclCollective:
    """One GPU a rank (``devices``, distinct), NCCL communicators made in this process (``ncclCommInitAll``).

    The all-gather of a call is one NCCL group: rank r's send is its part, its receive an [n, ...] buffer on its
    device, on that device's current stream (the ranks' kernels before and after are ordered on the same streams).
    Args: devices: the CUDA device ids, rank r on devices[r].
    Raises: ValueError for repeated or no devices; ImportError / RuntimeError from CuPy when NCCL is missing or its
    communicators cannot be made.
    """

    def __init__(self, devices: Sequence[int]) -> None:
        if not devices or len(set(devices)) != len(devices):
            raise ValueError(f"NcclCollective takes distinct devices, one a rank: {list(devices)}")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device notes)
        from cupy.cuda import nccl  # noqa: PLC0415 (CuPy's NCCL binding, only where a mesh runs on several GPUs)

        self._nccl: Any = nccl
        self.n, self.devices = len(devices), tuple(int(d) for d in devices)
        self._comms: list[Any] = list(nccl.NcclCommunicator.initAll(list(self.devices)))

    def all_gather(self, parts: Sequence[Any]) -> list[Any]:
        """See ``Collective.all_gather``: ncclAllGather of every rank in one group call."""
        shape = _check(parts, self.n)
        cp, nccl = cupy(), self._nccl
        outs: list[Any] = []
        for dev, p in zip(self.devices, parts):
            with cp.cuda.Device(dev):
                outs.append(cp.empty((self.n, *shape), dtype=cp.float32))
        count = int(parts[0].size)
        sends: list[Any] = []  # held until the group is queued
        nccl.groupStart()
        try:
            for comm, dev, p, out in zip(self._comms, self.devices, parts, outs):
                with cp.cuda.Device(dev):
                    sends.append(cp.ascontiguousarray(p))
                    comm.allGather(sends[-1].data.ptr, out.data.ptr, count, nccl.NCCL_FLOAT32,
                                   cp.cuda.get_current_stream().ptr)
        finally:
            nccl.groupEnd()
        return outs


def make_collective(devices: Sequence[int]) -> Collective:
    """``LocalCollective`` when every rank is on one device (or there is one rank), else ``NcclCollective``.
    Raises: ValueError for no devices, or devices that repeat without all being one."""
    devs = [int(d) for d in devices]
    if not devs:
        raise ValueError("a mesh needs at least one device")
    if len(set(devs)) == 1:
        return LocalCollective(len(devs), devs[0])
    if len(set(devs)) != len(devs):
        raise ValueError(f"tensor-parallel devices either all one GPU or all distinct, got {devs}")
    return NcclCollective(devs)
