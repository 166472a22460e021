"""The engine's prefix cache from its options: budgets in GB, the disk tier's folder and signature."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tandem.cache.signature import cache_signature, checkpoint_digest
from tandem.cache.store import GB, PrefixCache
from tandem.models.state import spec_signature


def state_signature(model: Any) -> str:
    """The model's state layout signature (``spec_signature`` of its buffer specs)."""
    specs = getattr(model, "state_specs", None)
    if specs is None:
        specs = getattr(getattr(model, "host", None), "state_specs", None)
    if specs is not None:
        return spec_signature(specs(1))
    return str(model.new_state(1).signature)


def build_cache(model: Any, root: Path, backend: str, chunk: int, default_gb: float, cache_gb: float | None,
                host_gb: float, cache_dir: str | Path | None, disk_gb: float) -> PrefixCache:
    """A ``PrefixCache`` on the snapshot grid ``chunk`` with ``cache_gb`` resident (``default_gb`` when None),
    ``host_gb`` host and, with ``cache_dir``, ``disk_gb`` on disk, signed over the checkpoint at ``root``; its
    files are written in the background (a request's end does not wait for the disk).

    Raises: ValueError: a negative or non-finite budget, an unusable cache_dir. OSError: an unreadable checkpoint file.
    """
    resident = default_gb if cache_gb is None else cache_gb
    if not all(math.isfinite(gb) and gb >= 0 for gb in (resident, host_gb, disk_gb)):
        raise ValueError(f"cache sizes must be finite numbers >= 0 GB, got {resident}, {host_gb}, {disk_gb} "
                         "(--cache-gb, --cache-host-gb, --cache-disk-gb)")
    signature = ""
    if cache_dir is not None:
        signature = cache_signature(checkpoint_digest(root), backend, chunk, state_signature(model))
    return PrefixCache(chunk, int(resident * GB), int(host_gb * GB), cache_dir, int(disk_gb * GB), signature,
                       background_writes=True)
