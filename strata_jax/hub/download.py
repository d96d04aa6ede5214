"""One file from the hub onto disk, resumable, ending verified or with an error, never a file that looks
done and is not.

What the server says about lengths is not trusted: the length that counts is the size the hub's
listing publishes, and the bytes that count are those whose sha256 matches the published one. So a
reply without Content-Length, a 206 whose Content-Range starts elsewhere than asked (refused, then
fetched whole), a 200 to a range request (written from byte 0), a dropped connection or a short body
(resumed with a range request), a CDN redirect (followed, without the token) all end in the same
check. The bytes go to NAME.part (beside it NAME.part.json names the size and sha256 they belong to,
so a part left by another revision is discarded, not resumed); only after the full hash matched is
the part fsynced and renamed to NAME and then NAME.verified.json written (size, mtime and sha256 of
what was checked). A marker whose size or mtime disagrees with the file is stale and discarded, and a
file without a valid marker is hashed again before it is trusted. A file whose sha256 the hub does not
publish is kept when its size matches, marked unverified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.client
import json
import logging
import os
import pathlib
import re
import time
import urllib.error
from collections.abc import Callable

from strata_jax.core.errors import HubError
from strata_jax.core.paths import file_lock
from strata_jax.hub.api import RemoteFile, _show, open_file

log = logging.getLogger("strata_jax")

CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")


@dataclasses.dataclass(frozen=True)
class Fetched:
    path: pathlib.Path
    size: int
    sha256: str  # of the bytes on disk
    verified: bool  # sha256 equals the hub's published one (False: the hub publishes none)
    downloaded: int  # bytes fetched this time (0: already there and verified)


def marker_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".verified.json")


def part_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".part")


def read_marker(path: pathlib.Path) -> dict | None:
    """The marker of `path` if it still describes the file (same size and mtime); a stale one is deleted."""
    mk = marker_path(path)
    try:
        rec = json.loads(mk.read_text())
        st = path.stat()
    except (OSError, ValueError):
        if mk.exists() and not path.exists():
            _unlink(mk)
        return None
    if not isinstance(rec, dict) or rec.get("size") != st.st_size or rec.get("mtime_ns") != st.st_mtime_ns:
        log.warning("pull: %s's completion marker is stale (the file changed since it was checked); discarded",
                    path.name)
        _unlink(mk)
        return None
    return rec


def _write_json(path: pathlib.Path, rec: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(rec, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_marker(path: pathlib.Path, sha256: str, verified: bool, source: dict) -> None:
    st = path.stat()
    _write_json(marker_path(path), {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                    "verified": verified, **source})
    _fsync_dir(path.parent)


def _unlink(p: pathlib.Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        p.unlink()


def _fsync_dir(folder: pathlib.Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def hash_file(path: pathlib.Path, limit: int | None = None, progress: Callable[[int], None] | None = None):
    h = hashlib.sha256()
    left = limit
    with open(path, "rb") as f:
        while left is None or left > 0:
            b = f.read(CHUNK if left is None else min(CHUNK, left))
            if not b:
                break
            h.update(b)
            if left is not None:
                left -= len(b)
            if progress:
                progress(len(b))
    return h


class _Retry(Exception):
    """A transfer that failed in a way a new request may fix (dropped, short, 5xx)."""


@dataclasses.dataclass
class _State:
    offset: int  # bytes of the part written and hashed
    h: "hashlib._Hash" = dataclasses.field(default_factory=hashlib.sha256)
    whole: bool = False  # no more range requests (the server's partial replies were wrong)
    fetched: int = 0  # bytes received this run

    def restart(self) -> None:
        self.offset, self.h = 0, hashlib.sha256()


class _Misaligned(_Retry):
    """A 206 for other bytes than asked: from now on the file is fetched whole, from byte 0."""


def fetch(url: str, remote: RemoteFile, dest: pathlib.Path, *, auth: str | None = None, retries: int = 5,
          backoff: float = 1.0, timeout: float = 60.0, source: dict | None = None,
          progress: Callable[[int], None] | None = None) -> Fetched:
    """Make `dest` a verified copy of `remote` (fetched from `url`), reusing a verified file or a
    resumable part. progress(n) is told of every n bytes fetched (or hashed when checking a file)."""
    if remote.size < 0:
        raise HubError(f"the hub publishes no size for {remote.path}: a complete download cannot be told from a "
                       "truncated one, so strata-jax refuses it.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(dest.with_name(f".{dest.name}.lock"), f"the download of {dest.name}"):
        have = _existing(dest, remote, source or {}, progress)
        if have is not None:
            return have
        return _download(url, remote, dest, auth, retries, backoff, timeout, source or {}, progress)


def _existing(dest: pathlib.Path, remote: RemoteFile, source: dict, progress) -> Fetched | None:
    if not dest.exists():
        _unlink(marker_path(dest))
        return None
    rec = read_marker(dest)
    size = dest.stat().st_size
    if rec and size == remote.size and (rec.get("sha256") == remote.sha256 or remote.sha256 is None and
                                        not rec.get("verified")):
        return Fetched(dest, size, rec["sha256"], bool(rec.get("verified")), 0)
    if size != remote.size:
        log.warning("pull: %s is %d bytes, the hub publishes %d: discarded", dest, size, remote.size)
    else:
        log.info("pull: %s has no valid completion marker; hashing it in full", dest.name)
        got = hash_file(dest, progress=progress).hexdigest()
        if remote.sha256 is None or got == remote.sha256:
            _write_marker(dest, got, remote.sha256 is not None, source)
            return Fetched(dest, size, got, remote.sha256 is not None, 0)
        log.warning("pull: %s has sha256 %s, the hub publishes %s: discarded", dest, got, remote.sha256)
    _unlink(marker_path(dest))
    _unlink(dest)
    return None


def _download(url, remote: RemoteFile, dest: pathlib.Path, auth, retries, backoff, timeout, source,
              progress) -> Fetched:
    part, side = part_path(dest), part_path(dest).with_name(part_path(dest).name + ".json")
    want = {"size": remote.size, "sha256": remote.sha256}
    try:
        same = json.loads(side.read_text()) == want
    except (OSError, ValueError):
        same = False
    if part.exists() and (not same or part.stat().st_size > remote.size):
        log.warning("pull: discarding %s: it belongs to another version of the file", part.name)
        _unlink(part)
    _write_json(side, want)
    st = _State(part.stat().st_size if part.exists() else 0)
    if st.offset:
        st.h = hash_file(part, st.offset)
        log.info("pull: resuming %s at %d of %d bytes", dest.name, st.offset, remote.size)
    failures, hash_failures = 0, 0
    while True:
        if st.offset == remote.size:
            got = st.h.hexdigest()
            if remote.sha256 is None or got == remote.sha256:
                break
            _unlink(part)
            hash_failures += 1
            msg = (f"{remote.path}: the downloaded bytes have sha256 {got}, the hub publishes {remote.sha256} "
                   f"(from {_show(url)})")
            if hash_failures > 1 or failures >= retries:
                _unlink(side)
                again = ", twice" if hash_failures > 1 else ""
                raise HubError(f"{msg}{again}: the server or the network corrupts the file. Nothing was kept; "
                               "retry later or from another endpoint (HF_ENDPOINT).")
            log.warning("pull: %s; discarded, downloading it again", msg)
            st.restart()
            continue
        try:
            with open(part, "ab" if st.offset else "wb") as f:
                _transfer(url, remote, f, st, auth, timeout, progress)
        except _Retry as e:
            if isinstance(e, _Misaligned):
                st.whole = True
            if st.whole:  # partial replies are not trusted any more: every attempt starts at byte 0
                st.restart()
                _unlink(part)
            failures += 1
            if failures > retries:
                raise HubError(f"{remote.path}: {e}; gave up after {retries} retries. {st.offset:,} of "
                               f"{remote.size:,} bytes are kept in {part}; run the same pull again to resume.") from None
            wait = min(backoff * 2 ** (failures - 1), 30.0)
            log.warning("pull: %s: %s; retry %d/%d in %.1f s from byte %d", dest.name, e, failures, retries, wait,
                        st.offset)
            time.sleep(wait)
    got = st.h.hexdigest()
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, dest)
    _fsync_dir(dest.parent)
    _write_marker(dest, got, remote.sha256 is not None, source)
    _unlink(side)
    return Fetched(dest, remote.size, got, remote.sha256 is not None, st.fetched)


def _transfer(url, remote: RemoteFile, f, st: "_State", auth, timeout, progress) -> None:
    """One request from st.offset, the body appended to the part `f` and hashed into st.h; raises _Retry
    with st as far as it got (every byte counted there is written and hashed)."""
    headers = {"Accept-Encoding": "identity"}
    if st.offset and not st.whole:
        headers["Range"] = f"bytes={st.offset}-"
    try:
        r = open_file(url, headers=headers, auth=auth, timeout=timeout)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise _Retry(f"request failed: {e}") from None
    with r:
        if r.status == 206:
            m = _CONTENT_RANGE.match(r.headers.get("Content-Range", ""))
            start = int(m[1]) if m else None
            total = int(m[3]) if m and m[3] != "*" else None
            if start != st.offset or total not in (None, remote.size):
                log.warning("pull: %s: asked for bytes %d-, the server answered Content-Range %r; its partial "
                            "replies are not trusted, fetching the whole file", remote.path, st.offset,
                            r.headers.get("Content-Range"))
                raise _Misaligned(f"misaligned partial reply (Content-Range {r.headers.get('Content-Range')!r} "
                                  f"to a request from byte {st.offset})")
        elif r.status == 200:
            if st.offset:
                log.warning("pull: %s: the server ignored the range request (200, the whole file); writing it "
                            "from byte 0", remote.path)
                f.seek(0)
                f.truncate(0)
                st.restart()
        else:
            raise _Retry(f"unexpected HTTP {r.status}")
        length = r.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) != remote.size - st.offset:
            log.warning("pull: %s: Content-Length %s, but %d bytes remain of the %d the hub publishes; reading "
                        "by the published size", remote.path, length, remote.size - st.offset, remote.size)
        try:
            while st.offset < remote.size:
                b = r.read(min(CHUNK, remote.size - st.offset))
                if not b:
                    break
                f.write(b)
                st.h.update(b)
                st.offset += len(b)
                st.fetched += len(b)
                if progress:
                    progress(len(b))
        except (OSError, http.client.HTTPException, ValueError) as e:
            f.flush()
            raise _Retry(f"connection lost after {st.offset:,} of {remote.size:,} bytes ({type(e).__name__})") from None
        f.flush()
        if st.offset < remote.size:
            raise _Retry(f"the body ended after {st.offset:,} of {remote.size:,} bytes")
