"""`strata-jax pull` and `--model REPO:FILE`: which files of a repo to fetch (a split set always whole),
where they go (the pull cache, or --dir), the progress line, and a model reference resolved to the
local path of its first shard.

The pull cache is cache_dir()/hub/OWNER--NAME/REVISION/FILE. A reference whose every file there has a
valid completion marker is used without asking the hub; otherwise it is pulled (and checked) first.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import pathlib
import re
import sys
import time
import urllib.parse

from strata_jax.core.errors import HubError
from strata_jax.core.paths import SHARD_NAME, cache_dir, shard_name
from strata_jax.core.units import fmt_bytes
from strata_jax.hub import api
from strata_jax.hub.download import fetch, read_marker

log = logging.getLogger("strata_jax")

REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[^:]+))?:(?P<file>.+)$")


@dataclasses.dataclass(frozen=True)
class PulledFile:
    path: pathlib.Path
    repo_path: str
    size: int
    sha256: str
    verified: bool
    downloaded: int


def default_dir(repo: str, revision: str) -> pathlib.Path:
    return cache_dir() / "hub" / repo.replace("/", "--") / urllib.parse.quote(revision, safe="")


def split_set(path: str) -> list[str]:
    """Every shard name of the split set `path` belongs to, in order; [path] for a file that is no shard."""
    m = SHARD_NAME.match(path.rsplit("/", 1)[-1])
    if not m:
        return [path]
    folder = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
    n = int(m["count"])
    return [folder + shard_name(m['prefix'], i, n) for i in range(1, n + 1)]


def select(listing: api.RepoListing, patterns: list[str]) -> list[api.RemoteFile]:
    """The files the patterns name (exact paths or globs), each shard's whole split set with it; without
    patterns the repo's one GGUF model (a file or a split set), refused when there are several."""
    names = sorted(listing.files)
    where = f"{listing.repo}@{listing.revision}"
    if patterns:
        picked = []
        for pat in patterns:
            hit = [n for n in names if n == pat] or [n for n in names if fnmatch.fnmatchcase(n, pat)]
            if not hit:
                raise HubError(f"{pat!r} matches no file of {where}; its GGUF files: {_models(listing) or 'none'}.")
            picked += hit
    else:
        models = {split_set(n)[0] for n in names if n.endswith(".gguf")}
        if not models:
            raise HubError(f"{where} has no .gguf file; name the file(s) to pull after the repository.")
        if len(models) > 1:
            raise HubError(f"{where} holds several GGUF models; name one (a glob works, e.g. '*Q4_K_M*'): "
                           f"{_models(listing)}.")
        picked = list(models)
    out: list[str] = []
    for n in picked:
        for s in split_set(n):
            if s not in listing.files:
                raise HubError(f"{where} lists {n} but not {s} of its split set; the upload is incomplete.")
            if s not in out:
                out.append(s)
    return [listing.files[s] for s in out]


def _models(listing: api.RepoListing) -> str:
    seen: dict[str, int] = {}
    for n, f in listing.files.items():
        if n.endswith(".gguf"):
            first = split_set(n)[0]
            seen[first] = seen.get(first, 0) + max(f.size, 0)
    return ", ".join(f"{n} ({fmt_bytes(b)})" for n, b in sorted(seen.items()))


class Progress:
    """GiB done / total, GiB/s and ETA: one `\\r` line on a TTY, a log line every few seconds otherwise."""

    def __init__(self, total: int, label: str, stream=None, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and _isatty(self.stream)
        self.t0 = self.last = time.monotonic()
        self.shown = False

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self.last >= (0.2 if self.tty else 5.0):
            self.last = now
            self.show(now)

    def line(self, now: float) -> str:
        gib = 1 << 30
        rate = self.done / max(now - self.t0, 1e-6)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta < 360000 else "--:--:--"
        return (f"{self.label} {self.done / gib:7.2f} / {self.total / gib:.2f} GiB "
                f"({100 * self.done / max(self.total, 1):3.0f}%) {rate / gib:6.2f} GiB/s ETA {eta_s}")

    def show(self, now: float) -> None:
        if self.tty:
            self.stream.write("\r" + self.line(now))
            self.stream.flush()
        else:
            log.info("%s", self.line(now))
        self.shown = True

    def close(self) -> None:
        if self.enabled and self.shown:
            self.show(time.monotonic())
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def pull(repo: str, files: list[str] | None = None, *, revision: str = "main", dest_dir: str | pathlib.Path | None = None,
         retries: int = 5, backoff: float = 1.0, timeout: float = 60.0, progress: bool = True) -> list[PulledFile]:
    """Fetch `files` of `repo` (see select) into dest_dir (default: the pull cache), each verified."""
    listing = api.listing(repo, revision, timeout=timeout)
    remote = select(listing, list(files or []))
    folder = pathlib.Path(dest_dir).expanduser() if dest_dir is not None else default_dir(repo, revision)
    total = sum(f.size for f in remote)
    log.info("pull: %s@%s (commit %s): %d file(s), %s, into %s", repo, revision, listing.commit or "unknown",
             len(remote), fmt_bytes(total), folder)
    bar = Progress(total, f"pull {repo}", enabled=progress)
    out = []
    try:
        for f in remote:
            url = api.file_url(listing.endpoint, repo, listing.commit or revision, f.path)
            got = fetch(url, f, folder / f.path, auth=api.token(), retries=retries, backoff=backoff, timeout=timeout,
                        source={"repo": repo, "revision": revision, "commit": listing.commit, "file": f.path},
                        progress=bar)
            out.append(PulledFile(got.path, f.path, got.size, got.sha256, got.verified, got.downloaded))
            if got.verified:
                log.info("pull: %s verified (%s, sha256 %s)%s", f.path, fmt_bytes(got.size), got.sha256,
                         "" if got.downloaded else ", already there")
            else:
                log.warning("pull: %s is UNVERIFIED: the hub publishes no sha256 for it; only its size (%s) "
                            "was checked", f.path, fmt_bytes(got.size))
    finally:
        bar.close()
    return out


def parse_ref(ref: str) -> tuple[str, str, str] | None:
    """(repo, revision, file) of `REPO[@REV]:FILE`, or None for anything else."""
    m = REF.match(ref)
    return (m["repo"], m["rev"] or "main", m["file"]) if m else None


def resolve_model(ref: str | None, *, progress: bool = True) -> str | None:
    """A local path for --model: an existing path as is; `REPO[@REV]:FILE` from the pull cache (pulled
    and verified first where any of its files has no valid marker there), as its first shard."""
    if ref is None or pathlib.Path(ref).expanduser().exists():
        return ref
    parsed = parse_ref(ref)
    if parsed is None:
        return ref  # not a reference: the GGUF reader names the missing file
    repo, revision, file = parsed
    folder = default_dir(repo, revision)
    shards = split_set(file)
    if any(c in file for c in "*?[") or not all(read_marker(folder / s) for s in shards):
        pulled = pull(repo, [file], revision=revision, progress=progress)
        ggufs = [p for p in pulled if p.repo_path.endswith(".gguf")]
        models = sorted({split_set(p.repo_path)[0] for p in ggufs})
        if len(models) != 1:
            raise HubError(f"{ref} names {len(models)} GGUF models ({', '.join(models) or 'none'}); name one file.")
        return str(folder / split_set(ggufs[0].repo_path)[0])
    log.info("model %s: the pull cache's verified copy in %s", ref, folder)
    return str(folder / shards[0])
