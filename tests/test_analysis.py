"""The research kit (offload/analysis.py, offload/traces.py, `strata-jax trace`): each analysis against a
trace small enough to work out by hand, no policy above Belady's optimum, and a recorded trace that
round-trips through its file and equals the engine's own record of the same run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import strata_jax
from strata_jax.bench.shapes import synthetic_model_path
from strata_jax.cli import main
from strata_jax.core.errors import ConfigError
from strata_jax.offload import analysis
from strata_jax.offload.simulate import simulate
from strata_jax.offload.traces import read_trace, save_trace

GRANITE = Path(__file__).resolve().parents[2] / "shared/traces/granite-3.0-1b-a400m/moe_expert_trace.json"
# one layer, top-2, experts 0-2: token 0 routes {0, 1}, token 1 {1, 2}, token 2 {1, 0}
HAND = np.array([[[0, 1]], [[1, 2]], [[1, 0]]], np.int32)


def test_the_analyses_match_a_hand_worked_trace():
    np.testing.assert_array_equal(analysis.frequency_LE(HAND), [[2, 3, 1]])
    # expert 1 again at tokens 1 and 2 (1 token after its last use each time), expert 0 at token 2 (2 after)
    np.testing.assert_array_equal(np.sort(analysis.reuse_distances(HAND)[0]), [1, 1, 2])
    # token 1 shares expert 1 of its 2 with token 0; token 2 shares expert 1 of its 2 with token 1
    np.testing.assert_allclose(analysis.next_token_overlap(HAND), [0.5])
    # the most used third of the experts (expert 1) takes 3 of 6 uses
    np.testing.assert_allclose(analysis.top_share(analysis.frequency_LE(HAND), 1 / 3), [0.5])
    # padding and a repeated id count once
    padded = np.array([[[2, 2, -1]]], np.int32)
    np.testing.assert_array_equal(analysis.frequency_LE(padded, 3), [[0, 0, 1]])
    # two slots: belady keeps 1 and evicts 0 for 2 at token 1, so token 2 hits 1 and misses 0: 2 of 6
    r = analysis.report(HAND, fractions=(2 / 3,), policies=("lru", "belady"))
    assert r["hit_rates"]["belady"] == [pytest.approx(2 / 6)] and r["experts_used"] == [3]
    assert math.isnan(analysis.hit_rates(HAND, (1 / 3,), ("lru",))["lru"][0])  # 1 slot < 2 experts a token


def test_mixed_precision_replay_matches_a_hand_worked_trace():
    """Two slots, LRU, promote after 1 low-bit use: token 0's misses take the two free slots; token 1 hits 1 and
    serves 2 low-bit (unproven, nothing free), so token 2 hits 1 and 0: 3 hits, 3 misses of which 1 low-bit.
    Plain LRU admits 2, evicting 0, and misses 0 again: 4 misses. At half the bytes a low-bit expert moves,
    (3 - 1 + 1 / 2) / 4 of plain's bytes."""
    r = simulate(HAND, "lru", 2, promote_after=1)
    assert (r["hits"], r["misses"], r["cold"]) == (3, 3, 1)
    (row,) = analysis.mixed_rows(HAND, (2 / 3,), (1,), cold_ratio=0.5)
    assert row["bytes_vs_plain"] == pytest.approx(2.5 / 4) and row["cold_share"] == pytest.approx(1 / 6)
    assert simulate(HAND, "lru", 2, promote_after=0)["cold"] == 0  # 0: plain offloading
    assert simulate(HAND, "lru", 2, promote_after=-1)["cold"] == 6  # -1: every miss low-bit
    with pytest.raises(ValueError, match="Belady"):
        simulate(HAND, "belady", 2, promote_after=1)


@pytest.mark.parametrize("per_layer", [False, True])
def test_no_policy_beats_belady(per_layer):
    rng = np.random.default_rng(0)
    traces = [rng.integers(0, 16, size=(60, 3, 4)).astype(np.int32)]
    if GRANITE.exists():
        traces.append(read_trace(GRANITE)[0][:120])
    for t in traces:
        rates = analysis.hit_rates(t, (0.25, 0.5, 0.75), per_layer=per_layer)
        for p, row in rates.items():
            for v, best in zip(row, rates["belady"]):
                assert math.isnan(v) or v <= best + 1e-12, (p, row, rates["belady"])


def test_a_recorded_trace_round_trips_and_is_the_engines_record(tmp_path, capsys):
    path = synthetic_model_path("tiny")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n\nthe rain in spain\n")
    out = tmp_path / "t.npz"
    assert main(["-q", "trace", "record", "--model", str(path), "--prompts", str(prompts), "--raw", "-n", "5",
                 "--out", str(out)]) == 0
    trace, meta = read_trace(out)
    assert [p["name"] for p in meta["prompts"]] == ["prompt0", "prompt1"] and meta["experts"] == 16
    assert meta["fingerprint"] == strata_jax.load(path).gguf.fingerprint()
    m = strata_jax.load(path, record_routing=True)
    for p in meta["prompts"]:
        start = len(m.routing_trace())
        m.generate(p["text"], max_tokens=5, temperature=0, cache_prompt=False)
        want = m.routing_trace()[start:]
        np.testing.assert_array_equal(read_trace(out, p["name"])[0], want)
        assert p["decode"] == 4 and p["prefill"] + p["decode"] == len(want)
    capsys.readouterr()
    assert main(["trace", "report", str(out), "--json", "--plots", str(tmp_path / "plots")]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tokens"] == len(trace) and set(r["hit_rates"]) == set(analysis.POLICIES)
    # the report's rates are the simulator's
    assert r["hit_rates"]["lru"][1] == simulate(trace, "lru", round(0.25 * 16 * r["layers"]), n_experts=16)["hit_rate"]
    assert sorted(f.name for f in (tmp_path / "plots").iterdir()) == ["hit_rate.png", "popularity.png",
                                                                     "reuse_distance.png"]


def test_bad_trace_files_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="no trace file"):
        read_trace(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="is not a routing trace file"):
        read_trace(tmp_path / "junk.npz")
    save_trace(tmp_path / "ok.npz", HAND, model="m", fingerprint="f", experts=3,
               prompts=[{"name": "a", "start": 0, "prefill": 2, "decode": 1}])
    with pytest.raises(ConfigError, match="prompt 'b' is not in"):
        read_trace(tmp_path / "ok.npz", "b")
    np.testing.assert_array_equal(read_trace(tmp_path / "ok.npz", "a")[0], HAND)


def test_bad_trace_command_input_is_refused_with_the_fix(tmp_path, capsys):
    trace = save_trace(tmp_path / "ok.npz", HAND, model="m", fingerprint="f", experts=3, prompts=[])
    with pytest.raises(SystemExit):
        main(["trace", "report", str(trace), "--fractions", "half"])
    assert "not a list of shares in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "report", str(trace), "--fractions", "0.5,2"])
    assert main(["trace", "report", str(tmp_path / "none.npz")]) == 2
    assert "no trace file" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    out = str(tmp_path / "t.npz")
    assert main(["trace", "record", "--model", "x.gguf", "--prompts", str(tmp_path / "missing.txt"), "--out", out]) == 2
    assert "no prompts file" in capsys.readouterr().err
    assert main(["trace", "record", "--model", "x.gguf", "--prompts", str(empty), "--out", out]) == 2
    assert "has no prompts: write one per line" in capsys.readouterr().err
