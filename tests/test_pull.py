"""`strata-jax pull` against a local fake hub (tests/fake_hub.py) that misbehaves in each way a real
server or CDN has: every case ends with a verified file or a clear error, never with a corrupt file
that looks done (no file under the final name, no completion marker)."""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np
import pytest

from fake_hub import FakeHub, HubFile
from strata_jax.cli import main
from strata_jax.core.errors import HubError
from strata_jax.hub import pull, resolve_model
from strata_jax.hub.download import marker_path, part_path

REPO = "acme/tiny-GGUF"
rng = np.random.default_rng(0)
DATA = {
    "tiny-Q4_K_M.gguf": HubFile(rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()),
    "nohash.gguf": HubFile(rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes(), publish_sha=False),
    "README.md": HubFile(b"# tiny\n", publish_sha=False, lfs=False),
    **{f"big/big-Q8_0-{i:05d}-of-00003.gguf": HubFile(rng.integers(0, 256, 120_000, dtype=np.uint8).tobytes())
       for i in (1, 2, 3)},
}
FILE = "tiny-Q4_K_M.gguf"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    h = FakeHub(REPO, dict(DATA))
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path / "cache"))
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    yield h
    h.stop()


def _pull(tmp_path, files=(FILE,), **kw):
    kw = {"retries": 4, "backoff": 0.0, "timeout": 5.0, "progress": False, **kw}
    return pull(REPO, list(files), dest_dir=tmp_path / "models", **kw)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _assert_verified(tmp_path, got, name=FILE):
    path = tmp_path / "models" / name
    assert path.read_bytes() == DATA[name].data
    assert got.verified and got.sha256 == _sha(DATA[name].data)
    rec = json.loads(marker_path(path).read_text())
    assert rec["verified"] and rec["sha256"] == got.sha256 and rec["size"] == len(DATA[name].data)
    assert not part_path(path).exists()


def _assert_nothing_looks_done(tmp_path, name=FILE):
    path = tmp_path / "models" / name
    assert not path.exists() and not marker_path(path).exists()


def _seed_part(tmp_path, n=100_000, name=FILE):
    """A resumable part of the first n bytes, as an interrupted pull leaves it."""
    part = part_path(tmp_path / "models" / name)
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(DATA[name].data[:n])
    part.with_name(part.name + ".json").write_text(json.dumps({"size": len(DATA[name].data),
                                                               "sha256": _sha(DATA[name].data)}))


def test_clean_pull_follows_the_cdn_redirect_without_the_token(hub, tmp_path):
    (got,) = _pull(tmp_path)
    _assert_verified(tmp_path, got)
    hub_side = [r for r in hub.requests if not r["cdn"]]
    cdn_side = [r for r in hub.requests if r["cdn"]]
    assert hub_side and all(r["auth"] == "Bearer hf_secret" for r in hub_side)
    assert cdn_side and all(r["auth"] is None for r in cdn_side)  # the token stays with the hub
    # a second pull trusts the marker: no file request at all
    n = len(hub.requests)
    (again,) = _pull(tmp_path)
    assert again.downloaded == 0 and len(hub.requests) == n


@pytest.mark.parametrize("fault, resume", [
    ("no_length", False),  # no Content-Length and the body stops at 2/3: resumed by range, not "complete"
    ("drop", False),  # connection cut mid-body: resumed by range
    ("truncate", False),  # a consistent Content-Length for half the file
    ("flip", False),  # one flipped byte: the hash refuses it and the file is fetched again
    ("misaligned", True),  # 206 from another offset than asked: refused, fetched whole
    ("ignore_range", True),  # 200 to a range request: written from byte 0
])
def test_each_fault_once_ends_verified(hub, tmp_path, fault, resume, caplog):
    if resume:  # these faults answer range requests only
        _seed_part(tmp_path)
    hub.set_fault(fault, times=1)
    with caplog.at_level(logging.WARNING, "strata_jax"):
        (got,) = _pull(tmp_path)
    # only the flipped byte needs the final hash to be caught; the others are refused as they arrive
    assert ("downloaded bytes have sha256" in caplog.text) == (fault == "flip")
    _assert_verified(tmp_path, got)
    cdn = [r for r in hub.requests if r["cdn"]]
    assert cdn[0]["fault"] == fault
    if fault == "ignore_range":  # the one reply is the whole file, written over the part from byte 0
        assert len(cdn) == 1 and got.downloaded == len(DATA[FILE].data)
    else:
        assert len(cdn) >= 2
    if fault in ("no_length", "drop", "truncate"):
        assert cdn[1]["range"] is not None and cdn[1]["range"] != "bytes=0-"  # resumed, not restarted
    if fault in ("flip", "misaligned"):
        assert cdn[1]["range"] is None  # restarted from byte 0 without a range


@pytest.mark.parametrize("fault, message", [
    ("flip", "sha256"),
    ("drop", "gave up"),
    ("no_length", "gave up"),
    ("truncate", "gave up"),
])
def test_each_fault_forever_ends_in_a_clear_error(hub, tmp_path, fault, message):
    hub.set_fault(fault, times=None)
    with pytest.raises(HubError, match=message) as e:
        _pull(tmp_path, retries=3)
    assert FILE in str(e.value)
    _assert_nothing_looks_done(tmp_path)


def test_misaligned_range_forever_still_verifies_by_fetching_whole(hub, tmp_path):
    _seed_part(tmp_path)
    hub.set_fault("misaligned", times=None)
    (got,) = _pull(tmp_path)
    _assert_verified(tmp_path, got)


def test_server_dies_mid_transfer_then_the_pull_resumes(hub, tmp_path):
    hub.set_fault("die", times=1)
    with pytest.raises(HubError, match="resume") as e:
        _pull(tmp_path, retries=1)
    assert "kept" in str(e.value)
    path = tmp_path / "models" / FILE
    kept = part_path(path).stat().st_size
    assert 0 < kept < len(DATA[FILE].data)
    _assert_nothing_looks_done(tmp_path)
    hub.restart()
    n = len(hub.requests)
    (got,) = _pull(tmp_path)
    _assert_verified(tmp_path, got)
    after = [r for r in hub.requests[n:] if r["cdn"]]
    assert after[0]["range"] == f"bytes={kept}-" and got.downloaded == len(DATA[FILE].data) - kept


def test_a_changed_file_invalidates_its_marker(hub, tmp_path, caplog):
    _pull(tmp_path)
    path = tmp_path / "models" / FILE
    b = bytearray(path.read_bytes())
    b[1234] ^= 0xFF
    path.write_bytes(bytes(b))  # same size, new mtime: the marker no longer describes it
    n = len(hub.requests)
    with caplog.at_level(logging.WARNING, "strata_jax"):
        (got,) = _pull(tmp_path)
    assert "stale" in caplog.text and "discarded" in caplog.text
    _assert_verified(tmp_path, got)
    assert any(r["cdn"] for r in hub.requests[n:])


def test_a_marker_without_its_file_and_a_wrong_size_file_are_discarded(hub, tmp_path):
    path = tmp_path / "models" / FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(DATA[FILE].data[:1000])  # looks done, is a prefix
    marker_path(path).write_text(json.dumps({"sha256": _sha(DATA[FILE].data), "size": len(DATA[FILE].data),
                                             "mtime_ns": 0, "verified": True}))
    (got,) = _pull(tmp_path)
    _assert_verified(tmp_path, got)


def test_a_file_without_a_marker_is_hashed_before_it_is_trusted(hub, tmp_path):
    path = tmp_path / "models" / FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(DATA[FILE].data)
    (got,) = _pull(tmp_path)
    _assert_verified(tmp_path, got)
    assert got.downloaded == 0 and not [r for r in hub.requests if r["cdn"]]
    wrong = bytearray(DATA[FILE].data)
    wrong[-1] ^= 1
    path.write_bytes(bytes(wrong))
    marker_path(path).unlink()
    (got,) = _pull(tmp_path)
    _assert_verified(tmp_path, got)


def test_a_part_of_another_version_is_not_resumed(hub, tmp_path):
    _seed_part(tmp_path)
    side = part_path(tmp_path / "models" / FILE).with_name(FILE + ".part.json")
    side.write_text(json.dumps({"size": len(DATA[FILE].data), "sha256": "0" * 64}))
    (got,) = _pull(tmp_path)
    _assert_verified(tmp_path, got)
    assert [r for r in hub.requests if r["cdn"]][0]["range"] is None


def test_a_file_without_a_published_hash_is_unverified(hub, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "strata_jax"):
        (got,) = _pull(tmp_path, ["nohash.gguf"])
    assert not got.verified and "UNVERIFIED" in caplog.text
    assert (tmp_path / "models" / "nohash.gguf").read_bytes() == DATA["nohash.gguf"].data
    assert json.loads(marker_path(got.path).read_text())["verified"] is False


def test_a_split_set_is_pulled_whole(hub, tmp_path):
    got = _pull(tmp_path, ["big/big-Q8_0-00002-of-00003.gguf"])
    assert [g.repo_path for g in got] == [f"big/big-Q8_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for g in got:
        _assert_verified(tmp_path, g, g.repo_path)


def test_selection_errors_name_the_choices(hub, tmp_path):
    with pytest.raises(HubError, match="several GGUF models.*big-Q8_0-00001-of-00003.gguf"):
        _pull(tmp_path, [])
    with pytest.raises(HubError, match="matches no file"):
        _pull(tmp_path, ["nope.gguf"])
    del hub.files["big/big-Q8_0-00003-of-00003.gguf"]
    with pytest.raises(HubError, match="incomplete"):
        _pull(tmp_path, ["big/*00001*"])
    with pytest.raises(HubError, match="HTTP 404"):
        pull("acme/missing", [FILE], dest_dir=tmp_path, progress=False)


def test_model_reference_is_pulled_once_into_the_cache(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):  # offline and not in the cache yet
        resolve_model(f"{REPO}:big/big-Q8_0-00003-of-00003.gguf", progress=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    path = resolve_model(f"{REPO}:big/big-Q8_0-00003-of-00003.gguf", progress=False)
    assert path.endswith("big-Q8_0-00001-of-00003.gguf") and str(tmp_path / "cache") in path
    n = len(hub.requests)
    hub.stop()  # the second use needs no hub, offline or not
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(f"{REPO}:big/big-Q8_0-00001-of-00003.gguf", progress=False) == path
    assert len(hub.requests) == n
    hub.restart()


# --- the CLI: pull, and --model REPO:FILE through the pull cache ----------------------------------------

@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf

    spec = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=64, head_dim=16, expert_ffn_dim=64, ffn_dim=64,
                         n_experts=4, n_experts_used=2, vocab_size=320, qtype="Q8_0")
    first = write_synthetic_gguf(tmp_path_factory.mktemp("split") / "moe.gguf", spec, split_max_tensors=12)
    return sorted(first.parent.glob("moe-*-of-*.gguf"))


@pytest.fixture
def model_hub(hub, split_model):
    for p in split_model:
        hub.files[f"moe/{p.name}"] = HubFile(p.read_bytes())
    return hub


def test_cli_pull_prints_what_was_verified(hub, tmp_path, capsys):
    assert main(["pull", REPO, FILE, "nohash.gguf", "--dir", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("verified") and FILE in out[0] and _sha(DATA[FILE].data) in out[0]
    assert out[1].startswith("UNVERIFIED") and "nohash.gguf" in out[1]
    hub.set_fault("flip", times=None)
    assert main(["pull", REPO, "big/*00001*", "--dir", str(tmp_path / "d"), "--retries", "1"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "sha256" in err and "Nothing was kept" in err


def test_cli_pull_refuses_negative_retries_before_asking_the_hub(hub, tmp_path, capsys):
    n = len(hub.requests)
    with pytest.raises(SystemExit) as e:  # argparse's own error: usage and one line, exit code 2
        main(["pull", REPO, FILE, "--dir", str(tmp_path / "d"), "--retries", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--retries must be >= 0, got -1" in err and "Traceback" not in err
    assert len(hub.requests) == n and not (tmp_path / "d").exists()


def test_model_ref_in_inspect_and_check(model_hub, split_model, capsys):
    n = len(split_model)
    assert n > 1
    ref = f"{REPO}:moe/moe-00001-of-{n:05d}.gguf"
    assert main(["inspect", "--model", ref]) == 0
    out = capsys.readouterr().out
    assert f"in {n} shards" in out and "qwen3moe" in out
    assert main(["check", ref, "--json", "--no-pinned-probe"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["model"]["shards"] == n and c["model"]["path"].endswith(f"moe-00001-of-{n:05d}.gguf")


def test_options_are_checked_before_anything_is_pulled(model_hub, capsys):
    n = len(model_hub.requests)
    assert main(["generate", "--model", f"{REPO}:moe/*", "--prompt", "hi", "--ctx", "0"]) == 2
    assert "--ctx" in capsys.readouterr().err and len(model_hub.requests) == n


def test_progress_line_shows_gib_rate_and_eta():
    import io
    import re

    from strata_jax.hub.pull import Progress

    class TTY(io.StringIO):
        def isatty(self):
            return True

    out = TTY()
    p = Progress(4 << 30, "pull acme/x", stream=out)
    p.t0 -= 10.0  # 1 GiB in 10 s: 0.1 GiB/s, 30 s left
    p.last -= 10.0
    p(1 << 30)
    p.close()
    line = out.getvalue().split("\r")[1]
    assert re.search(r"pull acme/x\s+1\.00 / 4\.00 GiB \( 25%\)\s+0\.10 GiB/s ETA 00:00:(29|30)", line), line
    assert out.getvalue().endswith("\n")


@pytest.mark.parametrize("fault", ["misaligned", "flip", "no_length"])
def test_plain_huggingface_hub_lets_it_through_strata_jax_does_not(hub, tmp_path, fault, monkeypatch):
    """huggingface_hub's own downloader (http_get, under hf_hub_download): given the published size, a
    206 from the wrong offset and a flipped byte both end in a file of the right length and the wrong
    bytes; without a size (a HEAD reply without one), a body without Content-Length that stops early is
    taken as the whole file. No error either way; the same server through strata-jax ends verified or
    refused."""
    hf = pytest.importorskip("huggingface_hub.file_download")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)  # read once, at its import
    data = DATA[FILE].data
    resume = 100_000 if fault == "misaligned" else 0
    hub.set_fault(fault, times=None)
    out = tmp_path / "hf.incomplete"
    with open(out, "wb") as f:
        f.write(data[:resume])
        hf.http_get(f"{hub.url}/cdn/{FILE}", f, resume_size=resume,
                    expected_size=None if fault == "no_length" else len(data))
    got = out.read_bytes()
    if got == data:
        pytest.skip("this huggingface_hub catches the fault itself")
    assert len(got) == (len(data) * 2 // 3 if fault == "no_length" else len(data))  # it looks complete
    if fault == "misaligned":
        _seed_part(tmp_path, resume)
        (pulled,) = _pull(tmp_path)
        _assert_verified(tmp_path, pulled)
    else:
        with pytest.raises(HubError, match="sha256" if fault == "flip" else "gave up"):
            _pull(tmp_path, retries=2)
        _assert_nothing_looks_done(tmp_path)
