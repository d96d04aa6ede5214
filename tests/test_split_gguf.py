"""A model split into llama.cpp's `NAME-0000k-of-0000N.gguf` shards loads from its first shard as one
model: the same tensors, logits and tokens as the unsplit file, resident and offloaded (the expert
store reading layers whose experts sit in different shards); a broken set of shards is refused with
an error that names the shard and the fix."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

import reference_models
import strata_jax
from strata_jax.core.errors import GGUFFormatError
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine.inspect import format_report, report
from strata_jax.gguf.reader import GGUFFile

# 4 MoE layers x 8 experts, odd layers' down projections in another type (two slot pools when shared);
# 51 tensors, 18 a shard: layer 2's gate and up land in shard 2, its down in shard 3
SPEC = SyntheticSpec(arch="qwen3moe", n_layers=4, d_model=128, head_dim=32, expert_ffn_dim=64, vocab_size=512,
                     qtype="Q8_0", expert_qtype="Q8_0", odd_down_qtype="Q4_0", seed=5)
MAX_TENSORS = 18
PROMPT = "the tea is hot and the rain is there, so she sat on the stairs to read"


def _write(folder, split_max_tensors=0):
    folder.mkdir()
    return write_synthetic_gguf(folder / "moe.gguf", SPEC, split_max_tensors=split_max_tensors)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    return _write(d / "whole"), _write(d / "split", MAX_TENSORS)


@pytest.fixture(scope="module")
def reference(files):
    m = strata_jax.load(files[0], ctx=128)
    ids = m.tokenize(PROMPT)
    return ids, m.logits(ids), m.generate(ids, max_tokens=16, temperature=0).token_ids


def test_shards_present_one_file(files):
    whole, first = map(GGUFFile, files)
    assert first.path.endswith("moe-00001-of-00003.gguf") and whole.n_shards == 1
    assert [p.rsplit("/", 1)[1] for p in first.shard_paths] == [f"moe-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert first.file_size == sum(first.shard_sizes) > whole.file_size  # three headers
    assert first.architecture == "qwen3moe" and first.get("qwen3moe.expert_count") == 8
    assert first.get("split.count") == 3 and first.get("split.tensors.count") == len(whole.tensors)
    assert list(first.tensors) == list(whole.tensors)
    for name, t in whole.tensors.items():
        s = first.tensors[name]
        assert (s.ggml_type, s.shape) == (t.ggml_type, t.shape)
        np.testing.assert_array_equal(s.data, t.data)
    exps = {n: t.shard for n, t in first.tensors.items() if "_exps." in n}
    assert set(exps.values()) == {0, 1, 2}
    layer2 = {exps[f"blk.2.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")}
    assert layer2 == {1, 2}  # one layer's expert rows are fused from two shards' maps


def test_split_loads_like_unsplit_resident(files, reference):
    ids, ref_logits, ref_tokens = reference
    m = strata_jax.load(files[1], ctx=128)
    assert m.cache_plan.resident
    np.testing.assert_array_equal(m.logits(ids), ref_logits)
    assert m.generate(ids, max_tokens=16, temperature=0).token_ids == ref_tokens


@pytest.mark.parametrize("pools,slots,store", [("per-layer", 8, None), ("shared", 6, None), ("per-layer", 8, "mapped"),
                                               ("shared", 6, "registered")])
def test_split_loads_like_unsplit_offloaded(files, reference, pools, slots, store, monkeypatch):
    """store: where the fetch kernel reads the experts (core/hostrows.py): in memory of our own, or the shards
    themselves mapped (a layer's expert tensors in two shards: one table row per tensor)."""
    ids, ref_logits, ref_tokens = reference
    if store is not None:
        from strata_jax.core import hostrows

        if not hostrows.available(jax.devices()[0]):
            pytest.skip(f"no C++ compiler to build the fetch kernel: {hostrows.why_not(jax.devices()[0])}")
        monkeypatch.setenv("STRATA_JAX_STORE", store)
    m = strata_jax.load(files[1], ctx=128, expert_slots=slots, expert_pools=pools,
                        expert_fetch="auto" if store is None else "kernel")
    assert not m.cache_plan.resident and m.experts.store is not None
    assert store is None or m.stats()["store_memory"] == store
    np.testing.assert_array_equal(m.logits(ids), ref_logits)
    assert m.generate(ids, max_tokens=16, temperature=0).token_ids == ref_tokens
    st = m.stats()
    assert st["misses"] > 0 and st["bytes_h2d"] > 0  # experts really came from the host store


def test_inspect_shows_the_shards(files):
    r = report(GGUFFile(files[1]))
    assert r["shards"] == 3 and r["file_bytes"] == sum(GGUFFile(files[1]).shard_sizes)
    assert format_report(r).splitlines()[0].endswith(" in 3 shards)")
    assert "shards" not in format_report(report(GGUFFile(files[0]))).splitlines()[0]


def _copy_shards(files, dest, which=(1, 2, 3)):
    src = GGUFFile(files[1]).shard_paths
    dest.mkdir()
    for i in which:
        shutil.copy(src[i - 1], dest / f"moe-0000{i}-of-00003.gguf")
    return dest / "moe-00001-of-00003.gguf"


def test_missing_shard_names_its_path(files, tmp_path):
    first = _copy_shards(files, tmp_path / "m", which=(1, 3))
    expected = tmp_path / "m" / "moe-00002-of-00003.gguf"
    with pytest.raises(GGUFFormatError, match=f"shard 2 is missing: expected {expected}.*same directory"):
        strata_jax.load(first, ctx=64)


def test_non_first_shard_points_at_the_first(files):
    second = GGUFFile(files[1]).shard_paths[1]
    with pytest.raises(GGUFFormatError, match=rf"is shard 2 of 3 of a split model; pass the first shard, "
                                              rf"{files[1]}"):
        GGUFFile(second)


def test_renamed_first_shard_is_refused(files, tmp_path):
    p = tmp_path / "model.gguf"
    shutil.copy(files[1], p)
    with pytest.raises(GGUFFormatError, match="its name does not end -00001-of-00003.gguf"):
        GGUFFile(p)


def test_shard_from_another_split_is_refused(files, tmp_path):
    # shard 2 in the place of shard 3: split.no disagrees with the name
    first = _copy_shards(files, tmp_path / "a")
    shutil.copy(tmp_path / "a" / "moe-00002-of-00003.gguf", tmp_path / "a" / "moe-00003-of-00003.gguf")
    with pytest.raises(GGUFFormatError, match=r"moe-00003-of-00003.gguf: its split metadata says shard 2 of 3 "
                                              r"\(split.no 1, split.count 3\)"):
        GGUFFile(first)
    # the second of a two-way split of the same model: split.count disagrees
    two = _write(tmp_path / "two", 26)
    first = _copy_shards(files, tmp_path / "b")
    shutil.copy(GGUFFile(two).shard_paths[1], tmp_path / "b" / "moe-00002-of-00003.gguf")
    with pytest.raises(GGUFFormatError, match=r"says shard 2 of 2 \(split.no 1, split.count 2\), but it is named "
                                              r"shard 2 of the 3"):
        GGUFFile(first)


def test_tensor_count_mismatch_is_refused(files, tmp_path):
    # the middle shard of another three-way split (17 tensors a shard): names and split.no agree, the
    # tensors do not add up to split.tensors.count
    other = _write(tmp_path / "other", 17)
    first = _copy_shards(files, tmp_path / "c")
    shutil.copy(GGUFFile(other).shard_paths[1], tmp_path / "c" / "moe-00002-of-00003.gguf")
    with pytest.raises(GGUFFormatError, match=r"split.tensors.count says the 3 shards hold 51 tensors, but they "
                                              r"hold 50 \(18, 17, 15\)"):
        GGUFFile(first)


@pytest.mark.slow  # runs llama.cpp's converter once (then cached)
def test_converter_split_output_loads(tiny_model):
    """llama.cpp's converter with --split-max-tensors: its shards load to the unsplit conversion's logits."""
    whole = tiny_model("mixtral", "q8_0").gguf_path
    first = reference_models.tiny_model_split("mixtral", "q8_0", max_tensors=12)
    g = GGUFFile(first)
    assert g.n_shards == 3 and len({t.shard for n, t in g.tensors.items() if "_exps." in n}) == 3
    ref = strata_jax.load(whole, ctx=64)
    ids = ref.tokenize("the quick brown fox jumps over the lazy dog")
    ref_logits, ref_tokens = ref.logits(ids), ref.generate(ids, max_tokens=8, temperature=0).token_ids
    for slots in (None, 6):  # resident, then offloaded (3 layers x top-2)
        m = strata_jax.load(first, ctx=64, expert_slots=slots)
        assert m.cache_plan.resident == (slots is None)
        np.testing.assert_array_equal(m.logits(ids), ref_logits)
        assert m.generate(ids, max_tokens=8, temperature=0).token_ids == ref_tokens
