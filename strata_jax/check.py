"""`strata-jax check [MODEL]`: is this machine fit, and does the model fit it.

The machine: the GPU (NVML through nvidia-ml-py where installed: name, memory, driver, PCIe generation
and width now against their maximum, loudly when the link runs narrower than it can), JAX's backend and
the free memory its allocator reports (what load sizes the expert cache from), pinned host->device
bandwidth (bench/limits.py's probe, on a modest buffer), RAM from /proc/meminfo, the largest pinned
host allocation that succeeds (halving from what the model's experts need, at most 80% of available RAM),
and free disk at the model's directory. An idle GPU lowers its PCIe generation to save power, so the
generation is read right after the bandwidth probe has loaded the link; the width does not change.

The verdict uses the engine's own planner (engine/inspect.py's report: model/memory.py's fixed bytes,
offload's cache plan) on the free device memory, and for an offloaded cache the expected hit rate of
LRU at that slot count on a realistic routing trace (offload/routing.py, fitted to Qwen3-30B-A3B's
published reuse). Without a GPU it says so and reports the CPU figures.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from strata_jax.core.units import fmt_bytes

log = logging.getLogger("strata_jax")

GiB = 1 << 30
PROBE_BYTES = 256 << 20  # bandwidth probe on a GPU: long enough to reach link speed, quick to run
PINNED_FLOOR = 256 << 20  # the halving stops below this
TRACE_TOKENS, TRACE_WARMUP = 256, 64


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def nvml_info(index: int = 0) -> dict[str, Any] | None:
    """NVML's view of GPU `index` (of those visible), or None without NVML or a GPU; 'error' when it fails."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return {"error": f"NVML did not start: {e}"}
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[index].strip()
        h = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        name = pynvml.nvmlDeviceGetName(h)
        driver = pynvml.nvmlSystemGetDriverVersion()
        out = {"name": name.decode() if isinstance(name, bytes) else name,
               "driver": driver.decode() if isinstance(driver, bytes) else driver,
               "memory_total": int(mem.total), "memory_free": int(mem.free), "handle": h}
        out.update(pcie_link(h))
        return out
    except Exception as e:  # noqa: BLE001
        return {"error": f"NVML: {e}"}


def pcie_link(handle) -> dict[str, int | None]:
    import pynvml

    def get(fn):
        try:
            return int(getattr(pynvml, fn)(handle))
        except Exception:  # noqa: BLE001 - not supported on this GPU (an SXM part may report none)
            return None

    return {"pcie_gen": get("nvmlDeviceGetCurrPcieLinkGeneration"),
            "pcie_gen_max": get("nvmlDeviceGetMaxPcieLinkGeneration"),
            "pcie_width": get("nvmlDeviceGetCurrPcieLinkWidth"),
            "pcie_width_max": get("nvmlDeviceGetMaxPcieLinkWidth")}


def largest_pinned(device, start: int, floor: int = PINNED_FLOOR) -> dict[str, int | None]:
    """The largest pinned host buffer of `start`, start/2, ... bytes that the device's client allocates."""
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device, memory_kind="pinned_host")
    size, failed = int(start), None
    while size >= floor:
        try:
            # np.zeros is untouched zero pages: only the pinned copy costs memory
            jax.device_put(np.zeros(size, np.uint8), sharding).block_until_ready()
            return {"bytes": size, "failed_at": failed}
        except (RuntimeError, ValueError, MemoryError) as e:
            log.info("check: %s of pinned host memory failed (%s)", fmt_bytes(size), str(e).splitlines()[0][:120])
            failed, size = size, size // 2
    return {"bytes": None, "failed_at": failed}


def expected_hit_rate(cfg, slots_per_layer: int) -> float:
    """LRU's hit rate after warm-up with `slots_per_layer` on offload/routing.py's realistic trace."""
    from strata_jax.offload.routing import lru_hit_rates, realistic_trace

    k = cfg.n_experts_used
    if slots_per_layer < k:
        return float("nan")
    trace = realistic_trace(TRACE_TOKENS, len(cfg.moe_layers), cfg.n_experts, k)
    return float(lru_hit_rates(trace, [slots_per_layer], TRACE_WARMUP, cfg.n_experts)[0])


def check(model: str | None = None, *, ctx: int | None = None, parallel: int = 1, vram_budget: str | None = None,
          probe_pinned: bool = True, cold_experts: str | None = None, kv_resident: int | None = None,
          devices: str | tuple[int, ...] | None = None) -> dict[str, Any]:
    """Everything `strata-jax check` reports, as one JSON-able dict. cold_experts: the low-bit copy
    (--cold-experts), whose experts take host RAM too; kv_resident: KV streaming (--kv-resident), the
    cache past that many positions a layer in host RAM."""
    import jax

    from strata_jax.offload.sizing import device_free_bytes

    out: dict[str, Any] = {"warnings": []}
    dev = jax.devices()[0]
    out["jax"] = {"version": jax.__version__, "backend": dev.platform, "device": str(dev),
                  "device_kind": getattr(dev, "device_kind", None), "free_bytes": device_free_bytes(dev)}
    gpu = dev.platform == "gpu"
    # several devices (--devices, or every GPU where there are several) split the expert cache: each one's figures
    from strata_jax.engine.config import check_option
    from strata_jax.engine.model import pick_devices

    cards = pick_devices(check_option("devices", devices, flag=True), None)
    if len(cards) > 1:
        have = jax.devices()
        out["cards"] = [{"index": have.index(d), "device": str(d), "device_kind": getattr(d, "device_kind", None),
                         "free_bytes": device_free_bytes(d)} for d in cards]
        free = [c["free_bytes"] for c in out["cards"]]
        out["jax"]["free_bytes"] = None if None in free else min(free)  # the budget is per card
    nv = nvml_info() if gpu else None
    mi = meminfo()
    out["ram"] = {"total": mi.get("MemTotal"), "available": mi.get("MemAvailable"), "free": mi.get("MemFree")}
    if not gpu:
        out["gpu"] = None
        out["warnings"].append(f"no GPU: JAX runs on {dev.platform}; the figures below are the CPU's")
    else:
        out["gpu"] = {k: v for k, v in (nv or {}).items() if k != "handle"}
        if nv is None:
            out["warnings"].append("nvidia-ml-py is not installed: no driver or PCIe link figures "
                                   "(pip install nvidia-ml-py)")
        elif "error" in nv:
            out["warnings"].append(nv["error"])
    from strata_jax.bench.limits import measure_bandwidths

    probes = measure_bandwidths(PROBE_BYTES if gpu else 64 << 20)
    out["bandwidth"] = {"host_to_device_GB_s": probes["link_GB_s"], "device_memory_GB_s": probes["hbm_GB_s"],
                        "host_memory_kind": probes["host_memory_kind"], "probe_bytes": probes["probe_bytes"]}
    if nv and "handle" in nv:
        out["gpu"].update(pcie_link(nv["handle"]))  # after the probe: the link at its working generation
        g = out["gpu"]
        if g.get("pcie_width") and g.get("pcie_width_max") and g["pcie_width"] < g["pcie_width_max"]:
            out["warnings"].append(
                f"the GPU's PCIe link runs at x{g['pcie_width']} of x{g['pcie_width_max']}: expert transfers get "
                f"{g['pcie_width']}/{g['pcie_width_max']} of the bandwidth. Reseat the card in a full-width slot "
                "or check the BIOS's lane split.")
        if g.get("pcie_gen") and g.get("pcie_gen_max") and g["pcie_gen"] < g["pcie_gen_max"]:
            out["warnings"].append(
                f"the GPU's PCIe link runs at Gen{g['pcie_gen']} of Gen{g['pcie_gen_max']} right after a transfer; "
                "check the slot, riser and BIOS PCIe setting (an idle GPU lowers it, a loaded one should not).")
    if probes["host_memory_kind"] != "pinned_host":
        out["warnings"].append("pinned host memory is not available: expert transfers run at pageable speed; "
                               "raise the locked-memory limit (ulimit -l)")
    if gpu:
        from strata_jax.core import hostrows

        ok = hostrows.available(dev)  # built with nvcc at first use, then cached
        out["fetch_kernel"] = {"available": ok, "why_not": None if ok else hostrows.why_not(dev)}
        if not ok:
            out["warnings"].append(
                f"the in-step fetch kernel cannot be built ({hostrows.why_not(dev)}): an offloaded model's misses are "
                "copied one by one instead, which holds the host once per miss. Install the CUDA toolkit's nvcc "
                "(or put it on PATH).")

    report = None
    if model is not None:
        from strata_jax.engine.inspect import report as model_report
        from strata_jax.gguf.reader import GGUFFile

        gguf = GGUFFile(model)
        budget = vram_budget if vram_budget is not None else out["jax"]["free_bytes"]
        report = model_report(gguf, vram_budget=budget, ctx=ctx, parallel=parallel, platform=dev.platform,
                              kv_resident=kv_resident, cards=len(cards))
        out["model"] = {"path": str(model), "file_bytes": report["file_bytes"], "shards": report["shards"],
                        "arch": report["config"].arch, "experts": report["experts"],
                        "expert_bytes_total": int(report["experts"] * report["expert_bytes"]),
                        "fixed_device_bytes": report["fixed_bytes"], "reserve_bytes": report["reserve_bytes"],
                        "dense_bytes": report["dense_bytes"], "kv_bytes": report["kv_bytes"],
                        "kv_storage": report["kv_label"], "activation_bytes": report["activation_bytes"],
                        "ctx": report["ctx"], "parallel": parallel, "kv_host_bytes": report["kv_host_bytes"]}
        if cold_experts is not None:
            from strata_jax.model.config import ModelConfig
            from strata_jax.model.memory import routed_expert_bytes

            cold = GGUFFile(cold_experts)
            out["model"]["cold_experts"] = str(cold_experts)
            out["model"]["cold_expert_bytes_total"] = routed_expert_bytes(cold, ModelConfig.from_gguf(cold))
    folder = Path(model).expanduser().resolve().parent if model else Path.cwd()
    du = shutil.disk_usage(folder)
    out["disk"] = {"path": str(folder), "free": du.free, "total": du.total}

    if gpu and probe_pinned:
        # never more than 80% of available RAM: pinning all of it would starve the host (and its other users)
        avail = int((mi.get("MemAvailable") or 0) * 0.8)
        mo = out.get("model", {})
        host = (mo.get("expert_bytes_total") or 0) + mo.get("cold_expert_bytes_total", 0) + mo.get("kv_host_bytes", 0)
        want = min(host or avail, avail or PINNED_FLOOR)
        want = max(want, PINNED_FLOOR)
        log.info("check: the largest pinned host allocation, halving from %s (--no-pinned-probe skips it)",
                 fmt_bytes(want))
        out["pinned"] = largest_pinned(dev, want) | {"asked": want}
    if report is not None:
        out["verdict"] = _verdict(report, out, gpu)
    return out


def _verdict(r: dict, out: dict, gpu: bool) -> dict[str, Any]:
    cfg = r["config"]
    cold = out["model"].get("cold_expert_bytes_total", 0)  # in host RAM too when offloading
    kv_host = out["model"].get("kv_host_bytes", 0)  # --kv-resident: the streamed part of the KV cache
    experts_total = out["model"]["expert_bytes_total"]
    ram = out["ram"].get("available")
    v: dict[str, Any] = {}
    if "vram_budget" not in r:  # CPU: no device memory limit
        # what load allocates there: every expert resident, the dense weights dequantized (inspect's figures)
        need = r["fixed_bytes"] + experts_total
        v["fits"] = ram is None or need <= ram
        v["mode"] = "cpu"
        v["text"] = (f"no GPU: the model runs on the CPU from RAM; it needs about {fmt_bytes(need)}: dense weights "
                     f"{fmt_bytes(r['dense_bytes'])}, KV cache {fmt_bytes(r['kv_bytes'])} at ctx {r['ctx']:,} "
                     f"({r['kv_label']})" + (f", experts {fmt_bytes(experts_total)}" if experts_total else "")
                     + f", activations {fmt_bytes(r['activation_bytes'])} "
                     f"({'fits' if v['fits'] else 'more than'} the {fmt_bytes(ram or 0)} available)")
        return v
    budget = fmt_bytes(r["vram_budget"])
    if r.get("cards", 1) > 1:
        budget = f"{r['cards']} cards x {budget}"
    if "too_small" in r or not r["fits_dense"]:
        v["fits"], v["mode"] = False, "does-not-fit"
        v["text"] = ("does not fit: " + r["too_small"] if "too_small" in r else
                     f"does not fit: {budget} of device memory < {fmt_bytes(r['fixed_bytes'])} of dense weights, "
                     f"kv cache and activations + {fmt_bytes(r['reserve_bytes'])} reserved; lower --ctx")
        return v
    kv_text = (f"; the KV cache past {r['kv_resident']:,} positions a layer ({fmt_bytes(kv_host)}) in host RAM"
               if kv_host else "")
    if not cfg.is_moe or r["plan"].resident:
        v["fits"], v["mode"] = True, "resident"
        v["text"] = f"fits resident in {budget} of device memory" + kv_text
        if ram is not None and kv_host > ram:
            v["fits"] = False
            v["text"] += f"; but the streamed KV cache exceeds the available RAM ({fmt_bytes(ram)})"
        return v
    plan = r["plan"]
    pct = 100 * plan.n_slots / max(r["experts"], 1)
    per_layer = plan.n_slots // max(len(cfg.moe_layers), 1)
    hit = expected_hit_rate(cfg, per_layer)
    v.update(fits=True, mode="offloaded", expert_slots=plan.n_slots, cached_percent=pct,
             expected_hit_rate=hit)
    v["text"] = (f"fits with {pct:.0f}% of experts cached ({plan.n_slots:,} of {r['experts']:,} slots in {budget}); "
                 f"expected LRU hit rate {100 * hit:.0f}% (realistic routing trace)")
    pinned = out.get("pinned", {}).get("bytes")
    if cold:
        v["text"] += f"; misses served from the low-bit copy ({fmt_bytes(cold)} of experts in host RAM too)"
    v["text"] += kv_text
    if ram is not None and experts_total + cold + kv_host > ram:
        v["fits"] = False
        what = "experts" + (" and their low-bit copy" if cold else "") + (" and the streamed KV cache" if kv_host else "")
        v["text"] += (f"; but its {what} ({fmt_bytes(experts_total + cold + kv_host)}) "
                      f"exceed the available RAM ({fmt_bytes(ram)})")
    elif gpu and pinned is not None and pinned < experts_total:
        v["text"] += (f"; pinned host memory stopped at {fmt_bytes(pinned)} of the experts' "
                      f"{fmt_bytes(experts_total)} in one buffer (the store pins one buffer per row layout, usually "
                      "all its layers: expect the pageable fallback)")
    return v


def format_check(c: dict[str, Any]) -> str:
    lines = []
    g = c.get("gpu")
    j = c["jax"]
    if g is None:
        lines.append(f"gpu           none (JAX backend: {j['backend']}, {j['device']})")
    else:
        lines.append(f"gpu           {g.get('name', j['device_kind'])}, driver {g.get('driver', '?')}, JAX {j['version']} "
                     f"({j['backend']})")
        if g.get("memory_total"):
            lines.append(f"vram          {fmt_bytes(g['memory_total'])} total, {fmt_bytes(g['memory_free'])} free "
                         f"(JAX's allocator: {fmt_bytes(j['free_bytes'] or 0)} free)")
        elif j["free_bytes"] is not None:
            lines.append(f"vram          JAX's allocator: {fmt_bytes(j['free_bytes'])} free")
        if g.get("pcie_width") or g.get("pcie_gen"):
            lines.append(f"pcie          Gen{g.get('pcie_gen')} x{g.get('pcie_width')} now, Gen{g.get('pcie_gen_max')} "
                         f"x{g.get('pcie_width_max')} max")
    for card in c.get("cards") or ():
        free = fmt_bytes(card["free_bytes"]) + " free" if card["free_bytes"] is not None else "no memory figure"
        lines.append(f"card {card['index']:<8} {card['device']} ({card['device_kind']}), {free}: its share of the "
                     "expert cache beside the dense weights and KV cache")
    b = c["bandwidth"]
    lines.append(f"host->device  {b['host_to_device_GB_s']:.1f} GB/s ({b['host_memory_kind']}, "
                 f"{fmt_bytes(b['probe_bytes'])} probe); device memory {b['device_memory_GB_s']:.0f} GB/s")
    r = c["ram"]
    if r["total"]:
        lines.append(f"ram           {fmt_bytes(r['total'])} total, {fmt_bytes(r['available'] or 0)} available")
    if "pinned" in c:
        p = c["pinned"]
        lines.append("pinned        " + (f"{fmt_bytes(p['bytes'])} in one allocation" if p["bytes"] else "none")
                     + (f" ({fmt_bytes(p['failed_at'])} failed)" if p["failed_at"] else " (as much as asked)"))
    if c.get("fetch_kernel") is not None:
        k = c["fetch_kernel"]
        lines.append("fetch kernel  " + ("built (misses cross PCIe in one kernel per layer)" if k["available"]
                                         else f"not available: {k['why_not']}"))
    d = c["disk"]
    lines.append(f"disk          {fmt_bytes(d['free'])} free of {fmt_bytes(d['total'])} at {d['path']}")
    if "model" in c:
        m = c["model"]
        lines.append(f"model         {m['path']} ({m['arch']}, {fmt_bytes(m['file_bytes'])}"
                     + (f" in {m['shards']} shards" if m["shards"] > 1 else "") + f", ctx {m['ctx']:,})")
        lines.append(f"verdict       {c['verdict']['text']}")
    for w in c["warnings"]:
        lines.append(f"WARNING       {w}")
    return "\n".join(lines)
