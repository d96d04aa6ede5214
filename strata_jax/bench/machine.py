"""What the bench needs to know about the machine before JAX starts: the GPU's total memory (to emulate
a smaller card), its name and driver, package versions; and the emulation itself.

`--vram-budget 32GiB` makes an H200 behave like a 32 GiB card in two ways: the cache is sized for the
budget (load(vram_budget=...)), and JAX's allocator is capped at budget / total device memory through
XLA_CLIENT_MEM_FRACTION (the current name of XLA_PYTHON_CLIENT_MEM_FRACTION, which JAX still reads but
calls deprecated; setting both is an error, so a user's old-name setting is the one replaced), so
anything the sizing leaves out (XLA workspace, fragmentation, a too-optimistic estimate) fails as it
would on the smaller card instead of borrowing the H200's spare memory. An explicit fraction also
turns off XLA's default "0.75+" policy, under which the pool may grow to the whole card. The variable
is read once, when JAX creates its GPU client, so it must be set before the first device use; the
total comes from nvidia-smi for that reason (asking JAX would start the backend). check_cap() then
compares the allocator's bytes_limit with the budget.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from strata_jax.core.units import fmt_bytes

log = logging.getLogger("strata_jax")

MiB = 1 << 20
GPU_FIELDS = ("name", "memory.total", "driver_version", "pcie.link.gen.max", "pcie.link.width.max")
CAP_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # current name, deprecated one


def nvidia_smi() -> dict | None:
    """The first visible GPU's fields (GPU_FIELDS) from nvidia-smi, or None where there is none."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 or not lines:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    index = int(visible) if visible.isdigit() and int(visible) < len(lines) else 0
    return dict(zip(GPU_FIELDS, (v.strip() for v in lines[index].split(","))))


def gpu_total_bytes(smi: dict | None) -> int | None:
    try:
        return int(float(smi["memory.total"]) * MiB) if smi else None
    except (KeyError, ValueError):
        return None


def backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # noqa: BLE001 - a private API; if it moved, assume the worst case (not started)
        return False


def apply_vram_cap(budget_bytes: int, smi: dict | None) -> dict:
    """Cap JAX's device allocations at budget_bytes (see the module docstring). Returns what was done:
    {'budget_bytes', 'total_bytes', 'fraction', 'variable', 'capped', 'note'}."""
    info = {"budget_bytes": budget_bytes, "total_bytes": None, "fraction": None, "variable": None, "capped": False,
            "note": ""}
    total = gpu_total_bytes(smi)
    if total is None:
        info["note"] = ("no NVIDIA GPU found (nvidia-smi): --vram-budget sizes the expert cache only, JAX's "
                        "allocations are not capped")
    elif backend_started():
        info["note"] = "JAX's backend had already started: its allocations could not be capped"
    elif budget_bytes >= total:
        info["note"] = f"the budget {fmt_bytes(budget_bytes)} is not below the card's {fmt_bytes(total)}: no cap"
    else:
        var = CAP_VARS[1] if os.environ.get(CAP_VARS[1]) and not os.environ.get(CAP_VARS[0]) else CAP_VARS[0]
        fraction = budget_bytes / total
        if os.environ.get(var):
            log.warning("%s=%s replaced by %.6f for --vram-budget", var, os.environ[var], fraction)
        os.environ[var] = f"{fraction:.6f}"
        info.update(total_bytes=total, fraction=fraction, variable=var, capped=True,
                    note=f"{var}={fraction:.6f} ({fmt_bytes(budget_bytes)} of {fmt_bytes(total)})")
    (log.info if info["capped"] else log.warning)("vram budget: %s", info["note"])
    return info


def check_cap(cap: dict, bytes_limit: int | None) -> None:
    """Record whether the allocator's limit is the budget (within 2%: it is a fraction of CUDA's total,
    a little below nvidia-smi's); an ineffective cap is logged loudly and its rows are not called capped."""
    if not cap or not cap["capped"]:
        return
    cap["jax_bytes_limit"] = bytes_limit
    # no limit reported: JAX runs on another platform (JAX_PLATFORMS=cpu on a GPU machine, say)
    cap["effective"] = bytes_limit is not None and bytes_limit <= cap["budget_bytes"] * 1.02
    if not cap["effective"]:
        log.error("the VRAM cap did not take: JAX's allocator limit is %s, not %s (%s); rows are marked uncapped",
                  fmt_bytes(bytes_limit) if bytes_limit is not None else "unknown", fmt_bytes(cap["budget_bytes"]),
                  cap["note"])


def uncapped_env() -> dict:
    """This process's environment without the allocation cap (for a child that must see the whole card)."""
    return {k: v for k, v in os.environ.items() if k not in CAP_VARS}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """HEAD of the checkout, or $STRATA_JAX_COMMIT where the code travelled without its .git (GPU box)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists() or not shutil.which("git"):
        return os.environ.get("STRATA_JAX_COMMIT")
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _user_xla_flags() -> str:
    """XLA_FLAGS less what strata-jax adds by itself (runtime.py): what a reproduction must set by hand."""
    from strata_jax import runtime

    ours = {f"{k}={v}" for k, v in runtime.applied.items()}
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in ours)


# the environment switches a reproduction must set too (engine/config.py reads them); the cache location is not one
_ENV_SWITCHES = ("STRATA_JAX_QMATVEC", "STRATA_JAX_MOE_PREFILL", "STRATA_JAX_XLA_DEFAULTS", "STRATA_JAX_COMPILATION_CACHE")


def _user_env() -> str:
    """The STRATA_JAX_* switches set for this run, as `NAME=value` words ('' when none)."""
    return " ".join(f"{k}={os.environ[k]}" for k in _ENV_SWITCHES if os.environ.get(k))


def machine_info(smi: dict | None) -> dict:
    """Everything about the machine that is known without starting JAX's backend."""
    import strata_jax

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": smi.get("name") if smi else None,
        "gpu_memory_MiB": int(float(smi["memory.total"])) if smi and smi.get("memory.total") else None,
        "driver": smi.get("driver_version") if smi else None,
        "pcie": (f"Gen{smi['pcie.link.gen.max']} x{smi['pcie.link.width.max']}"
                 if smi and smi.get("pcie.link.gen.max", "").isdigit() else None),
        "host_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "jax_cuda_plugin": _version("jax-cuda13-plugin") or _version("jax-cuda12-plugin"),
        "strata_jax": strata_jax.__version__,
        "commit": _git_commit(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_flags_user": _user_xla_flags(),
        "env_user": _user_env(),
    }


def device_peak_bytes() -> int | None:
    """The device allocator's peak bytes in use in this process (None where the backend keeps no stats)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        stats = {}
    return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None


def device_info() -> dict:
    """What JAX reports once its backend runs: the device and the allocator's limit (the cap at work)."""
    import jax

    dev = jax.devices()[0]
    out = {"jax_device": str(dev), "jax_platform": dev.platform, "jax_device_kind": getattr(dev, "device_kind", None)}
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        stats = {}
    out["jax_bytes_limit"] = int(stats["bytes_limit"]) if "bytes_limit" in stats else None
    return out
