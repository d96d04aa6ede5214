"""`strata-jax check`: the machine's figures (here a CPU machine: it must say there is no GPU) and the
fit verdict, which must be the engine's own planner's (engine/inspect.py's report) and, for an
offloaded cache, the LRU hit rate of offload/routing.py's realistic trace at that slot count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import pytest

from strata_jax import check as chk
from strata_jax.cli import main
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine.inspect import report
from strata_jax.gguf.reader import GGUFFile
from strata_jax.offload.routing import lru_hit_rates, realistic_trace

MOE = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                    n_experts=16, n_experts_used=2, vocab_size=512, qtype="Q8_0")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return str(write_synthetic_gguf(tmp_path_factory.mktemp("check") / "moe.gguf", MOE))


@pytest.fixture(scope="module")
def machine():
    return chk.check(None)


def test_cpu_machine_says_no_gpu_and_reports_cpu_figures(machine):
    assert jax.devices()[0].platform == "cpu"
    assert machine["gpu"] is None and any("no GPU" in w for w in machine["warnings"])
    with open("/proc/meminfo") as f:
        total_kib = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1])
    assert machine["ram"]["total"] == total_kib * 1024
    assert abs(machine["disk"]["free"] - shutil.disk_usage(machine["disk"]["path"]).free) < 1 << 30
    assert machine["bandwidth"]["host_to_device_GB_s"] > 0
    text = chk.format_check(machine)
    assert "gpu           none" in text and "ram" in text and "disk" in text


def _budgets(path, platform=None):
    """(dense + KV + activations + reserve, every expert) as load sizes them on `platform` (default: here)."""
    r = report(GGUFFile(path), vram_budget=None, platform=platform)
    experts = r["experts"] * r["expert_bytes"]
    base = r["fixed_bytes"] + r["reserve_bytes"]
    return base, experts


@pytest.mark.parametrize("mode", ["resident", "offloaded", "does-not-fit"])
def test_verdict_is_the_planners(moe_path, mode):
    base, experts = _budgets(moe_path)
    budget = {"resident": base + experts + (1 << 20), "offloaded": int(base + experts / 2),
              "does-not-fit": base // 2}[mode]
    c = chk.check(moe_path, vram_budget=str(budget), probe_pinned=False)
    v = c["verdict"]
    assert v["mode"] == mode and v["fits"] == (mode != "does-not-fit")
    r = report(GGUFFile(moe_path), vram_budget=budget)
    if mode == "offloaded":
        assert v["expert_slots"] == r["expert_slots"] and 0 < v["cached_percent"] < 100
        per_layer = r["expert_slots"] // 2
        trace = realistic_trace(chk.TRACE_TOKENS, 2, MOE.n_experts, MOE.n_experts_used)
        want = lru_hit_rates(trace, [per_layer], chk.TRACE_WARMUP, MOE.n_experts)[0]
        assert v["expected_hit_rate"] == pytest.approx(want) and 0 < want < 1
        # fewer slots, fewer hits: the rate follows the plan, not a constant
        assert chk.expected_hit_rate(r["config"], MOE.n_experts_used) < want
        assert f"{v['cached_percent']:.0f}% of experts cached" in v["text"]
    if mode == "does-not-fit":
        assert r["too_small"] in v["text"] and "smallest budget" in v["text"]


def test_the_low_bit_copy_counts_in_host_ram(moe_path, tmp_path, monkeypatch, capsys):
    """--cold-experts: the copy's experts are named and counted in the offloaded verdict's RAM figure."""
    import dataclasses

    cold = str(write_synthetic_gguf(tmp_path / "cold.gguf", dataclasses.replace(MOE, qtype="Q8_0",
                                                                               expert_qtype="Q4_0")))
    base, experts = _budgets(moe_path)
    c = chk.check(moe_path, vram_budget=str(int(base + experts / 2)), probe_pinned=False, cold_experts=cold)
    cold_bytes = c["model"]["cold_expert_bytes_total"]
    assert 0 < cold_bytes < c["model"]["expert_bytes_total"]
    assert c["verdict"]["mode"] == "offloaded" and "low-bit copy" in c["verdict"]["text"]
    monkeypatch.setattr(chk, "meminfo", lambda: {"MemAvailable": experts + cold_bytes // 2, "MemTotal": 1 << 40})
    v = chk.check(moe_path, vram_budget=str(int(base + experts / 2)), probe_pinned=False, cold_experts=cold)["verdict"]
    assert not v["fits"] and "and their low-bit copy" in v["text"]
    assert main(["check", moe_path, "--cold-experts", str(tmp_path / "none.gguf")]) == 2
    assert "--cold-experts" in capsys.readouterr().err


def test_the_streamed_kv_cache_counts_in_host_ram(moe_path, monkeypatch, capsys):
    """--kv-resident: the KV cache past the resident positions is named and counted in host RAM."""
    base, experts = _budgets(moe_path)
    budget = str(int(base + experts / 2))
    c = chk.check(moe_path, vram_budget=budget, probe_pinned=False, ctx=4096, kv_resident=256)
    host = c["model"]["kv_host_bytes"]
    assert host == report(GGUFFile(moe_path), vram_budget=budget, ctx=4096, kv_resident=256)["kv_host_bytes"] > 0
    assert "past 256 positions a layer" in c["verdict"]["text"]
    assert main(["check", moe_path, "--ctx", "4096", "--kv-resident", "256", "--vram-budget", budget,
                 "--no-pinned-probe"]) == 0
    assert "positions a layer" in capsys.readouterr().out
    monkeypatch.setattr(chk, "meminfo", lambda: {"MemAvailable": experts + host // 2, "MemTotal": 1 << 40})
    v = chk.check(moe_path, vram_budget=budget, probe_pinned=False, ctx=4096, kv_resident=256)["verdict"]
    assert not v["fits"] and "streamed KV cache" in v["text"]


def test_cli_json_and_model_refs(moe_path, capsys):
    assert main(["check", moe_path, "--json", "--no-pinned-probe"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["gpu"] is None and c["verdict"]["mode"] == "cpu" and c["model"]["arch"] == "qwen3moe"
    assert main(["check", moe_path, "--model", moe_path]) == 2
    assert "give the model once" in capsys.readouterr().err


def test_cli_refuses_a_bad_vram_budget_before_the_model(capsys):
    assert main(["check", "/nonexistent/model.gguf", "--vram-budget", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert "--vram-budget 'nonsense' is not a size" in err and "no such file" not in err and "Traceback" not in err


def test_largest_pinned_halves_until_it_fits(monkeypatch):
    calls = []
    real = jax.device_put

    def fake_put(x, sharding):
        calls.append(x.nbytes)
        if x.nbytes > 3 << 20:
            raise RuntimeError("RESOURCE_EXHAUSTED: pinned host allocation failed")
        return real(x, sharding)

    monkeypatch.setattr(jax, "device_put", fake_put)
    got = chk.largest_pinned(jax.devices()[0], 16 << 20, floor=1 << 20)
    assert got == {"bytes": 2 << 20, "failed_at": 4 << 20} and calls == [16 << 20, 8 << 20, 4 << 20, 2 << 20]


class _FakeGPU:
    """The CPU device dressed as a GPU whose allocator has `free` bytes (what the planner sizes from)."""

    platform, device_kind = "gpu", "NVIDIA H200"

    def __init__(self, free):
        self.free = free

    def memory_stats(self):
        return {"bytes_limit": self.free, "bytes_in_use": 0}

    def __str__(self):
        return "cuda:0"


def _fake_nvml(width, width_max, gen=5, gen_max=5):
    import types

    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=141 << 30, free=140 << 30)
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlSystemGetDriverVersion = lambda: "580.00"
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: gen
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: gen_max
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: width
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: width_max
    return m


@pytest.mark.parametrize("width, width_max", [(8, 16), (16, 16)])
def test_gpu_path_warns_loudly_when_the_link_runs_narrow(moe_path, monkeypatch, width, width_max):
    import sys

    from strata_jax.bench import limits

    base, experts = _budgets(moe_path, "gpu")  # bfloat16, dense weights in their blocks
    free = int(base + experts / 2)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(width, width_max))
    monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGPU(free)])
    monkeypatch.setattr(limits, "_probes", {"link_GB_s": 25.0, "hbm_GB_s": 4000.0, "probe_bytes": 1 << 28,
                                            "host_memory_kind": "pinned_host", "reps": 3})
    from strata_jax.core import hostrows

    # a machine without nvcc (narrow link) and one with it: the fetch kernel is reported either way
    monkeypatch.setattr(hostrows, "available", lambda dev: width == width_max)
    monkeypatch.setattr(hostrows, "why_not", lambda dev: "no compiler found (nvcc for CUDA, g++/clang++ for CPU)")
    c = chk.check(moe_path, probe_pinned=False)
    assert c["fetch_kernel"]["available"] == (width == width_max)
    assert any("fetch kernel cannot be built (no compiler found" in w for w in c["warnings"]) == (width < width_max)
    g = c["gpu"]
    assert (g["name"], g["pcie_width"], g["pcie_width_max"], g["memory_total"]) == ("NVIDIA H200", width, width_max,
                                                                                     141 << 30)
    narrow = [w for w in c["warnings"] if "PCIe link runs at x8 of x16" in w]
    assert bool(narrow) == (width < width_max) and not any("no GPU" in w for w in c["warnings"])
    # the verdict sizes the cache from the allocator's free memory, as load does
    assert c["verdict"]["mode"] == "offloaded"
    assert c["verdict"]["expert_slots"] == report(GGUFFile(moe_path), vram_budget=free,
                                                                 platform="gpu")["expert_slots"]
    text = chk.format_check(c)
    assert f"Gen5 x{width} now, Gen5 x{width_max} max" in text and "25.0 GB/s" in text
    assert ("WARNING       the GPU's PCIe link runs at x8" in text) == (width < width_max)
    assert ("fetch kernel  built" in text) == (width == width_max)


@pytest.mark.parametrize("command", ["inspect", "check"])
def test_cli_without_a_model_uses_the_default_model(moe_path, monkeypatch, capsys, command):
    """As generate does: no path means the embedded default model (here a stand-in, no download)."""
    from strata_jax.dev import default_model

    asked = []
    monkeypatch.setattr(default_model, "default_model_path", lambda *a, **k: asked.append(1) or Path(moe_path))
    assert main([command] + (["--json", "--no-pinned-probe"] if command == "check" else [])) == 0
    out = capsys.readouterr().out
    assert asked == [1]
    if command == "check":
        assert json.loads(out)["model"]["path"] == str(moe_path)
    else:
        assert out.startswith(f"file          {moe_path} ")
