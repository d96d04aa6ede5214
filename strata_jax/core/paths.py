"""Where strata-jax keeps files between runs (the cache root), the lock that lets processes share it, and
the names of a split GGUF's shards (the loader and the hub both need them)."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; writers still publish by atomic rename
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("strata_jax")

# the shard names llama.cpp writes and looks for (llama_split_path: "%s-%05d-of-%05d.gguf", 1-based)
SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_name(prefix: str, no: int, count: int) -> str:
    """The file name of shard `no` (1-based) of `count` of the split set `prefix`."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def cache_dir() -> pathlib.Path:
    """Root of strata-jax's cache: $STRATA_JAX_CACHE, else ~/.cache/strata-jax."""
    env = os.environ.get("STRATA_JAX_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "strata-jax"


@contextlib.contextmanager
def file_lock(lock_path: pathlib.Path, what: str = "") -> Iterator[None]:
    """Exclusive advisory lock (fcntl.flock) held for the block; released on exit or process death."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another process building %s (lock %s)", what or lock_path.parent, lock_path)
                fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)
