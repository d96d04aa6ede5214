"""runtime.configure_xla: the XLA flags a fresh process gets (each case its own interpreter, since the flags
only act before JAX starts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import os, strata_jax; print(os.environ.get('XLA_FLAGS', ''))"


def flags(tmp_path, **env) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "STRATA_JAX_COMPILATION_CACHE")}
    e.update(STRATA_JAX_CACHE=str(tmp_path), **env)
    return subprocess.run([sys.executable, "-c", SHOW], env=e, capture_output=True, text=True, check=True).stdout


def test_autotune_cache_beside_the_program_cache(tmp_path):
    import importlib.metadata

    got = flags(tmp_path)
    version = importlib.metadata.version("jaxlib")
    assert f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path / 'xla-autotune' / version}" in got
    assert "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" in got


@pytest.mark.parametrize("env,absent", [
    ({"STRATA_JAX_COMPILATION_CACHE": "0"}, "autotune_cache_dir"),  # cold-compile benchmarks: nothing on disk
    ({"STRATA_JAX_XLA_DEFAULTS": "0"}, "--xla_gpu"),
])
def test_opt_outs(tmp_path, env, absent):
    assert absent not in flags(tmp_path, **env)


def test_the_users_flags_win(tmp_path):
    got = flags(tmp_path, XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/elsewhere")
    assert got.count("autotune_cache_dir") == 1 and "/elsewhere" in got
