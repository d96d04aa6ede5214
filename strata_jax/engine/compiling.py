"""Say when a jitted program compiles, and for how long: a cold start spends tens of seconds in XLA
after the "loaded" line, which would otherwise pass in silence and be mistaken for a hang.

JAX reports each compilation (tracing, lowering, XLA's backend compile or a read from the persistent
cache) through jax.monitoring; a listener counts them, so a call can tell whether it compiled.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import jax
from jax import monitoring

log = logging.getLogger("strata_jax")

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # compiled, or read from the persistent cache
CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_counts = {"compiles": 0, "cache_hits": 0}
_announced: set[str] = set()  # programs whose first compilation has been announced in this process
_installed = False
_seconds = 0.0  # wall seconds of calls that compiled, since the process started


def _on_duration(event: str, duration_secs: float, **_: object) -> None:
    if event == BACKEND_COMPILE:
        with _lock:
            _counts["compiles"] += 1


def _on_event(event: str, **_: object) -> None:
    if event == CACHE_HIT:
        with _lock:
            _counts["cache_hits"] += 1


def install() -> None:
    """Register the listeners (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


def cache_where() -> str:
    d = jax.config.jax_compilation_cache_dir
    return f"cached in {d}" if d else "not cached on disk: the compilation cache is off"


def compile_seconds() -> float:
    """Wall seconds spent in calls that compiled a program, since the process started."""
    return _seconds


def waited(seconds: float) -> None:
    """Count wall seconds a caller spent waiting on a compile it did not run itself (a program compiled
    on a thread) in compile_seconds."""
    global _seconds
    with _lock:
        _seconds += seconds


def announce(program: str, how: str = "") -> None:
    """Say that `program`'s first compilation in the process starts (once): the wait that follows is XLA's."""
    with _lock:
        if program in _announced:
            return
        _announced.add(program)
    log.info("compiling the %s program%s (first run only; %s)...", program, how, cache_where())


@contextlib.contextmanager
def watch(program: str, shape: str = ""):
    """Around one jitted call of `program` (e.g. "decode"): its first compilation in the process is
    announced before (the wait that follows is XLA's), and any compilation is logged after with its
    wall time; a call that compiles nothing logs nothing."""
    global _seconds
    install()
    announce(program)
    before = dict(_counts)
    t0 = time.perf_counter()
    yield
    compiled = _counts["compiles"] - before["compiles"]
    if compiled:
        dt = time.perf_counter() - t0
        _seconds += dt
        hits = _counts["cache_hits"] - before["cache_hits"]
        how = "read from the compilation cache" if hits >= compiled else "compiled"
        log.info("%s the %s program%s in %.1f s", how, program, f" ({shape})" if shape else "", dt)
