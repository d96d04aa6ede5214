"""`strata-jax bench` end to end on the tiny shape (CPU): rows for both routing modes, the resident
reference in a child process, llama.cpp's rows merged from a stand-in llama-bench; the limit-ratio
arithmetic, the VRAM cap, the targets and the docs-table renderer."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from strata_jax.bench import limits, machine, peer, table
from strata_jax.bench.shapes import SHAPES, synthetic_model_path
from strata_jax.model import memory

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).resolve().parent / "data" / "llama_bench_cpu_small.json"
GiB = 1 << 30


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One bench run: resident (in a child process) and LRU 50%, both routing modes, two prefill lengths,
    a 2 GiB budget (every expert fits: its configuration equals resident and is not run twice), decode in
    3-step calls, a q8_0 KV cache, speculative passes of 3 tokens, and a stand-in llama-bench that prints a real llama-bench JSON (tests/data)
    for every placement."""
    from strata_jax.cli import main

    tmp = tmp_path_factory.mktemp("bench")
    fake = tmp / "llama-bench"
    fake.write_text(f"#!/bin/sh\ncat '{FIXTURE}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp / "results-tiny.json"
    argv = ["bench", "--shape", "tiny", "--tokens", "8", "--prompt-len", "8", "--prefill-len", "32", "--prefill-len",
            "64", "--cache-fraction", "0.5", "--routing", "model", "--routing", "realistic", "--vram-budget", "2GiB",
            "--resident-process", "child", "--peer-llama-bench", str(fake), "--peer-reps", "2", "--decode-chunk", "3",
            "--kv", "q8_0", "--spec-pass", "3", "--out", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text()), out


def test_rows(bench_run):
    doc, _ = bench_run
    ours = [r for r in doc["rows"] if r["engine"] == "strata-jax"]
    assert all("error" not in r for r in ours), [r.get("error") for r in ours]
    assert sorted((r["config_kind"], r["routing"]) for r in ours) == [
        ("fraction", "model"), ("fraction", "realistic"), ("resident", "model"), ("resident", "realistic")]
    total = SHAPES["tiny"].n_layers * SHAPES["tiny"].n_experts
    for r in ours:
        assert r["shape"] == "tiny" and r["n_tokens"] == 8 and r["decode_tok_s"] > 0
        assert r["same_tokens"] is True  # offloading and forced routing change where bytes live, not the math
        assert 0 <= r["hit_rate"] <= 1
        assert r["limit_ratio"] > 0 and r["limit_ms_per_token"] > 0 and r["hbm_MB_per_token"] > 0
        assert r["total_experts"] == total
        assert r["host_dispatch_ms_per_step"] > 0 and r["host_wait_ms_per_step"] >= 0
        # --decode-chunk reaches every configuration, the child's too, and names it: 7 steps in 3 calls
        assert r["decode_chunk"] == 3 and r["decode_calls"] == 3
        assert r["kv"] == "q8_0"  # --kv too
        if r["config_kind"] == "resident":
            assert r["process"].startswith("child") and r["vram_cap_bytes"] is None
            assert r["resident"] and r["hit_rate"] == 1.0 and r["misses"] == 0
            assert r["decode_MB_per_token"] == r["pcie_MB_per_token"] == r["decode_h2d_GB_s"] == 0
            assert r["prefill_tok_s"] == {}  # the child is the token reference: decode only
        else:
            assert set(r["prefill_tok_s"]) == {"32", "64"} and min(r["prefill_tok_s"].values()) > 0
            assert not r["resident"] and r["expert_slots"] == total // 2 and r["store_memory"] == "pinned_host"
            # a prefill chunk streams every expert of every layer from the host store
            assert all(v > 0 for v in r["prefill_h2d_GB_s"].values())
            # --spec-pass 3: every draft accepted (bench/spec.py): 7 steps, two passes of 3 and a plain last step
            (sp,) = r["speculation"]
            assert sp["pass_tokens"] == 3 and sp["forced_accept"] == 1.0
            assert sp["draft_n_accepted"] == sp["draft_n"] == 4 and sp["passes"] == 2 and sp["plain_steps"] == 1
            assert sp["decode_tok_s"] > 0 and sp["ms_per_call"] > 0
            per_expert = np.mean(limits.ModelBytes.of(*_gguf_cfg(doc["model"])).expert_M)
            assert r["pcie_MB_per_token"] == pytest.approx((r["misses"] + r["prefetched"]) * per_expert / 7 / 1e6)
    # the resident rows differ between routing modes only in what they route: both carry their tokens
    res = {r["routing"]: r for r in ours if r["config_kind"] == "resident"}
    assert len(res["model"]["token_ids"]) == len(res["realistic"]["token_ids"]) == 8


def test_a_drafter_decodes_the_rows(tmp_path):
    """--spec: the decode runs with that drafter and its rows carry the draft counts; a bad one is refused
    before anything loads."""
    from strata_jax.cli import main

    out = tmp_path / "spec.json"
    assert main(["bench", "--shape", "tiny", "--tokens", "12", "--prompt-len", "8", "--no-resident", "--spec",
                 "lookup", "--spec-max", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row and row["draft_n"] >= row["draft_n_accepted"] >= 0 and "draft_passes" in row
    assert main(["bench", "--shape", "tiny", "--spec", "guess", "--out", str(tmp_path / "bad.json")]) == 2


def test_cold_experts_rows(tmp_path, monkeypatch):
    """--cold-qtype: the shape written again with low-bit experts serves the offloaded rows' misses; the rows
    carry the low-bit share and count those misses at their own bytes."""
    from strata_jax.cli import main

    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cold.json"
    assert main(["bench", "--shape", "tiny", "--tokens", "12", "--prompt-len", "8", "--no-resident", "--cold-qtype",
                 "Q4_0", "--promote-after", "-1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row and "cold after -1" in row["config"] and row["cold_share"] == 1.0
    assert row["decode_MB_per_token"] > 0


@pytest.mark.parametrize("flags, named", [
    (["--cold-qtype", "Q4_0", "--promote-after", "-5"], "--promote-after"),
    (["--cold-experts", "no-such-copy.gguf"], "--cold-experts"),
    (["--cold-qtype", "NOPE"], "--cold-qtype"),
])
def test_mixed_precision_options_are_checked_first(tmp_path, monkeypatch, capsys, flags, named):
    """Bad mixed-precision options stop the bench before any file is written or model loaded, naming the flag."""
    from strata_jax.cli import main

    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    assert main(["bench", "--shape", "tiny", "--tokens", "4", "--no-resident", *flags, "--out", str(out)]) == 2
    assert named in capsys.readouterr().err and not out.exists() and not (tmp_path / "cache").exists()


def test_failures_are_rows(tmp_path, monkeypatch):
    """A configuration that cannot load, and a prefill that fails, become rows that say so; the rest of the
    run goes on (the decode figures of the failed prefill's row stay, the next mode gets a fresh model)."""
    from strata_jax.bench import cli, run

    real, calls = run._prefill, []

    def flaky(model, ids):
        calls.append(len(ids))
        if len(calls) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: stand-in for an out-of-memory prefill")
        return real(model, ids)

    monkeypatch.setattr(run, "_prefill", flaky)
    out = tmp_path / "r.json"
    # 1 GiB is less than the engine's default 1 GiB reserve plus the dense weights: that load must fail
    assert cli.main(["--shape", "tiny", "--tokens", "4", "--prompt-len", "8", "--prefill-len", "16", "--prefill-len",
                     "32", "--no-resident", "--cache-fraction", "0.5", "--vram-budget", "1GiB", "--routing", "model",
                     "--routing", "realistic", "--out", str(out)]) == 0
    rows = {(r["config_kind"], r["routing"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("fraction", "model"), ("fraction", "realistic"), ("budget", "model"), ("budget", "realistic")}
    bad = rows["fraction", "model"]
    assert bad["decode_tok_s"] > 0 and set(bad["prefill_tok_s"]) == {"16"}
    assert "RESOURCE_EXHAUSTED" in bad["prefill_errors"]["32"]
    good = rows["fraction", "realistic"]
    assert "load_s" in good and set(good["prefill_tok_s"]) == {"16", "32"} and "prefill_errors" not in good
    for routing in ("model", "realistic"):
        error = rows["budget", routing]["error"]
        assert error.startswith("load: ConfigError") and "too small" in error
        assert rows["fraction", routing]["same_tokens"] is None  # no resident reference in this run
    region = table.render(table.load([out]))
    assert "failed: load: ConfigError" in region


def _gguf_cfg(path):
    from strata_jax.model.config import ModelConfig
    from strata_jax.gguf.reader import GGUFFile

    g = GGUFFile(path)
    return g, ModelConfig.from_gguf(g)


def test_document(bench_run):
    doc, _ = bench_run
    m = doc["machine"]
    for key in ("date", "jax", "jaxlib", "python", "host_cores", "jax_device", "gpu", "driver"):
        assert key in m
    assert doc["command"].startswith("strata-jax bench --shape tiny") and "--routing realistic" in doc["command"]
    assert doc["probes"]["link_GB_s"] > 0 and doc["probes"]["hbm_GB_s"] > 0
    assert doc["routing_seed"] == 0
    if shutil.which("nvidia-smi") is None:
        assert not doc["vram"]["capped"] and "nvidia-smi" in doc["vram"]["note"]
    # the 2 GiB budget holds every expert: its configuration is the resident one, measured once
    assert not any(r.get("config_kind") == "budget" for r in doc["rows"])


def test_llama_rows_merged(bench_run):
    doc, _ = bench_run
    fx = json.loads(FIXTURE.read_text())
    pre = next(x for x in fx if x["n_gen"] == 0)
    dec = next(x for x in fx if x["n_prompt"] == 0)
    rows = {r["placement"]: r for r in doc["rows"] if r["engine"] == "llama.cpp"}
    assert set(rows) == {"all-gpu", "cpu-experts", "budget"}
    if shutil.which("nvidia-smi") is None:
        assert doc["peer_when"] == "after"  # no GPU to share: after our rows
        # our capped rows first, then llama.cpp, then the child's resident reference
        assert [r["engine"] for r in doc["rows"]] == ["strata-jax"] * 2 + ["llama.cpp"] * 3 + ["strata-jax"] * 2
    for r in rows.values():
        assert "error" not in r and r["shape"] == "tiny"
        assert r["decode_tok_s"] == dec["avg_ts"] and r["prefill_tok_s_by_len"] == {"64": pre["avg_ts"]}
        assert "-p 32" in r["command"] and "-p 64" in r["command"]  # the longest prompt is the main -p
        assert r["fits_budget"] is True
    assert rows["cpu-experts"]["n_cpu_moe"] == SHAPES["tiny"].n_layers and rows["budget"]["n_cpu_moe"] == 0


def test_render_updates_only_the_region(bench_run, tmp_path):
    _, out = bench_run
    doc = tmp_path / "benchmarks.md"
    shutil.copy(ROOT / "docs" / "benchmarks.md", doc)
    before = doc.read_text()
    b, e = before.index(table.BEGIN), before.index(table.END)
    assert table.main([str(out), "--update", str(doc)]) == 0
    after = doc.read_text()
    nb, ne = after.index(table.BEGIN), after.index(table.END)
    assert after[:nb] == before[:b] and after[ne:] == before[e:]  # outside the markers: untouched
    region = after[nb:ne]
    # every row ran 3 decode steps per jitted call (--decode-chunk 3), and its configuration says so
    assert "| strata-jax | resident, 3-step decode calls, q8_0 KV (32 experts) | realistic |" in region
    assert "| strata-jax | LRU 50%, 3-step decode calls, q8_0 KV (16 of 32 slots, 50%) | model |" in region
    assert "| llama.cpp | all experts on the CPU | its router |" in region
    assert "Limit ratio = " in region and "#### Targets (issue 5)" in region
    assert "strata-jax bench --shape tiny" in region and "llama.cpp all-gpu: `" in region
    assert table.main([str(out), "--update", str(doc)]) == 0
    assert doc.read_text() == after  # idempotent
    # a run under user XLA_FLAGS (an A/B of the defaults) is labelled as such in its rows
    variant = json.loads(out.read_text())
    variant["machine"]["xla_flags_user"] = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    (tmp_path / "variant.json").write_text(json.dumps(variant))
    both = table.render(table.load([out, tmp_path / "variant.json"]))
    assert ("| strata-jax | resident, 3-step decode calls, q8_0 KV (32 experts, "
            "`XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP`) |") in both
    assert "| strata-jax | resident, 3-step decode calls, q8_0 KV (32 experts) | realistic |" in both
    # so is a run under a STRATA_JAX_* switch, in its rows and its command
    variant["machine"]["env_user"] = "STRATA_JAX_QMATVEC=1"
    (tmp_path / "variant.json").write_text(json.dumps(variant))
    both = table.render(table.load([out, tmp_path / "variant.json"]))
    assert ("| strata-jax | resident, 3-step decode calls, q8_0 KV (32 experts, `STRATA_JAX_QMATVEC=1 "
            "XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP`) |") in both
    assert " with `STRATA_JAX_QMATVEC=1 XLA_FLAGS=" in both
    # runs of one machine at two commits: one description naming both
    a, b = table.load([out, out])
    a["machine"]["commit"], b["machine"]["commit"] = "ba9876543210", "0123456789ab"
    machine_lines = [ln for ln in table.render([a, b]).splitlines() if ln.startswith("Machine:")]
    assert len(machine_lines) == 1 and machine_lines[0].endswith(" at ba9876543210, 0123456789ab.")
    bare = tmp_path / "bare.md"
    bare.write_text("# no markers\n")
    assert table.main([str(out), "--update", str(bare)]) == 2 and bare.read_text() == "# no markers\n"


def _row(shape, routing, decode, **kw):
    r = {"engine": "strata-jax", "shape": shape, "routing": routing, "decode_tok_s": decode, "config": "LRU",
         "config_kind": "budget", "vram_cap_bytes": 32 * GiB}
    r.update(kw)
    return r


def test_targets():
    rows = [
        _row("bseed", "realistic", 250.0, prefill_tok_s={"4096": 3500.0}),
        _row("bseed", "model", 60.0, limit_ratio=0.4, prefill_tok_s={"4096": 2000.0}),
        _row("bseed", "model", 90.0, vram_cap_bytes=None, limit_ratio=0.95),  # not under the cap: not counted
        _row("b30", "model", 320.0, config_kind="resident", vram_cap_bytes=None),
        _row("b30", "realistic", 200.0, config_kind="fraction", cache_fraction=0.5),
        {"engine": "llama.cpp", "shape": "bseed", "placement": "budget", "decode_tok_s": 150.0, "fits_budget": True},
        {"engine": "llama.cpp", "shape": "bseed", "placement": "all-gpu", "decode_tok_s": 300.0, "fits_budget": False},
        {"engine": "llama.cpp", "shape": "b30", "placement": "all-gpu", "decode_tok_s": 300.0},
    ]
    lines = table.targets(rows)[2:]
    assert len(lines) == 5
    assert "budget, 150 tok/s, measured): 300 tok/s" in lines[0]  # 2x the best fitting placement > 200
    assert lines[0].endswith("| 250 tok/s, LRU | no: 83% of it (-50.0) |")
    assert "0.40 (LRU, 60.0 tok/s)" in lines[1] and "no: 50% of it" in lines[1]
    assert "320 tok/s" in lines[2] and "**yes** (1.07x)" in lines[2]
    assert "240 tok/s" in lines[3] and "no: 83% of it" in lines[3]
    assert "3,500 tok/s (realistic routing)" in lines[4] and "no: 67% of it" in lines[4]  # the worse mode counts
    # a prefill that failed says so, in the row and in the target
    oom = _row("bseed", "model", 37.0, prefill_errors={"512": "prefill: JaxRuntimeError: RESOURCE_EXHAUSTED: Out of"})
    assert "- (prefill failed: out of memory at 512 tokens)" in table.targets([oom])[-1]
    assert "| failed: out of memory |" in "\n".join(table.shape_table([dict(oom, prefill_tok_s={})]))
    # without peer rows the llama.cpp figures stand in, and say so
    assert "the issue's figure" in table.targets([])[2]


def test_limit_figures():
    mb = limits.ModelBytes(dense_read=1_000_000, expert_M=(100_000, 200_000), experts_total=0, dense_total=0, k=2,
                           kv_elems_per_position=1000)
    counters = np.array([[5, 3, 99, 1, 0, 0], [6, 2, 99, 0, 0, 0]])  # hits, misses, streamed, prefetched, ...
    probes = {"link_GB_s": 50.0, "hbm_GB_s": 4000.0}
    f = limits.limit_figures(mb, counters, decode_steps=4, decode_tok_s=100.0, context=10, itemsize=2, probes=probes)
    pcie = ((3 + 1) * 100_000 + 2 * 200_000) / 4  # streamed (prefill) experts are not decode traffic
    hbm = 1_000_000 + 2 * 300_000 + 1000 * 2 * 10
    assert f["pcie_MB_per_token"] == pytest.approx(pcie / 1e6) and f["hbm_MB_per_token"] == pytest.approx(hbm / 1e6)
    limit = pcie / 50e9 + hbm / 4000e9
    assert f["limit_ms_per_token"] == pytest.approx(limit * 1e3)
    assert f["limit_ratio"] == pytest.approx(limit / 0.01)
    resident = limits.limit_figures(mb, None, 4, 100.0, 10, 2, probes)
    assert resident["pcie_MB_per_token"] == 0 and resident["limit_ratio"] == pytest.approx(hbm / 4000e9 / 0.01)


def test_model_bytes_and_resident_estimate():
    gguf, cfg = _gguf_cfg(synthetic_model_path("tiny"))
    mb = limits.ModelBytes.of(gguf, cfg)
    assert mb.dense_total - mb.dense_read == gguf.tensor("token_embd.weight").nbytes
    assert sum(mb.expert_M) * cfg.n_experts == mb.experts_total
    assert mb.dense_total + mb.experts_total == sum(t.nbytes for t in gguf.tensors.values())
    est = limits.resident_estimate(gguf, cfg, ctx=1024, itemsize=2)
    assert est == (mb.dense_total + mb.experts_total + mb.kv_elems_per_position * 1024 * 2
                   + memory.activation_bytes(cfg, 512) + GiB)
    for kv in ("q8_0", "q8_0,q4_0"):  # a quantized cache: the limit's KV reads and the estimate shrink alike
        q = limits.ModelBytes.of(gguf, cfg, kv)
        assert q.kv_bytes_per_position(2) == memory.kv_cache_bytes(cfg, 1, 1, 2, kv) < mb.kv_bytes_per_position(2)
        assert est - limits.resident_estimate(gguf, cfg, ctx=1024, itemsize=2, kv=kv) == 1024 * (
            mb.kv_bytes_per_position(2) - q.kv_bytes_per_position(2))


def test_vram_cap(monkeypatch):
    for var in machine.CAP_VARS:
        monkeypatch.delenv(var, raising=False)
    smi = {"name": "NVIDIA H200", "memory.total": "143771", "driver_version": "580.159.04"}
    monkeypatch.setattr(machine, "backend_started", lambda: False)
    info = machine.apply_vram_cap(32 * GiB, smi)
    assert info["capped"] and info["variable"] == "XLA_CLIENT_MEM_FRACTION"
    assert float(os.environ["XLA_CLIENT_MEM_FRACTION"]) == pytest.approx(32768 / 143771, abs=1e-6)
    assert "XLA_CLIENT_MEM_FRACTION" not in machine.uncapped_env()
    machine.check_cap(info, 32 * GiB - (100 << 20))  # CUDA's total is a little below nvidia-smi's
    assert info["effective"]
    machine.check_cap(info, int(0.75 * (143771 << 20)))  # the variable was not read: XLA's default pool
    assert not info["effective"]
    machine.check_cap(info, None)  # JAX on another platform: no allocator limit, no cap
    assert not info["effective"]
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    # a user's deprecated-name setting is replaced (JAX refuses both names at once)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert machine.apply_vram_cap(32 * GiB, smi)["variable"] == "XLA_PYTHON_CLIENT_MEM_FRACTION"
    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert not machine.apply_vram_cap(200 * GiB, smi)["capped"]  # not below the card's size
    none = machine.apply_vram_cap(32 * GiB, None)
    assert not none["capped"] and "nvidia-smi" in none["note"]
    monkeypatch.setattr(machine, "backend_started", lambda: True)
    late = machine.apply_vram_cap(32 * GiB, smi)
    assert not late["capped"] and "already started" in late["note"]
    assert not any(var in os.environ for var in machine.CAP_VARS)


def test_peer_fits_after(monkeypatch):
    for var in machine.CAP_VARS:
        monkeypatch.delenv(var, raising=False)
    h200 = 143771 << 20
    assert peer.fits_after(17_200_000_000, h200, None)  # B30 beside JAX's default 75%
    assert not peer.fits_after(43_000_000_000, h200, None)  # BSEED does not: llama.cpp goes first
    assert peer.fits_after(43_000_000_000, h200, 32 * GiB / h200)  # beside a 32 GiB cap it does
    assert peer.fits_after(10**15, None, None)  # no GPU: nothing to share


def test_peer_missing_binary():
    rows = peer.run_peer("/nonexistent/llama-bench", "m.gguf", budget=None, prefill_lens=[512], n_gen=8, reps=1)
    assert rows == [{"engine": "llama.cpp", "error": "/nonexistent/llama-bench: no such executable"}]


def test_peer_command():
    cmd = peer.peer_command("/x/llama-bench", "m.gguf", budget=32 * GiB, prefill_lens=[4096, 512], n_gen=128, reps=3,
                            out="o.json")
    assert cmd[cmd.index("--placement") + 1] == "all-gpu,cpu-experts,budget"
    assert cmd[cmd.index("--n-prompt") + 1] == "4096" and cmd[cmd.index("--budget-gib") + 1] == "32"
    assert cmd[-3:] == ["--extra", "-p", "512"]
    bare = peer.peer_command("b", "m.gguf", budget=None, prefill_lens=[], n_gen=16, reps=1, out="o.json")
    assert "budget" not in bare[bare.index("--placement") + 1] and "--extra" not in bare
    only = peer.peer_command("b", "m.gguf", budget=32 * GiB, prefill_lens=[512], n_gen=16, reps=1, out="o.json",
                             placements=["budget"])
    assert only[only.index("--placement") + 1] == "budget"
    deep = peer.peer_command("b", "m.gguf", budget=None, prefill_lens=[512], n_gen=16, reps=1, out="o.json",
                             depth=16000, kv="q8_0")
    assert deep[deep.index("--depth") + 1] == "16000" and deep[deep.index("--cache-type") + 1] == "q8_0"
    assert "--depth" not in bare and "--cache-type" not in bare


@pytest.mark.parametrize("value", ["lots", "100", "0"])
def test_a_bad_prefill_chunk_is_refused_before_anything_loads(value, tmp_path, capsys):
    """--prefill-chunk takes what --prefill-chunk of generate/serve takes; anything else exits 2 naming the
    flag and what it accepts, before a model is written or loaded."""
    from strata_jax.bench.cli import main

    out = tmp_path / "r.json"
    assert main(["--shape", "tiny", "--prefill-chunk", value, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--prefill-chunk" in err and "is invalid" in err and "power of two" in err and not out.exists()
