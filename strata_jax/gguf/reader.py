"""Memory-mapped GGUF access with clear errors.

The file is memory-mapped once (zero-copy) and its header parsed here (gguf-py supplies the type
enums; its GGUFReader is slow on large vocabularies); we expose metadata as plain Python values and
every tensor as its raw GGML bytes, `uint8[..., row_bytes]`, whatever its type (F32 and F16 tensors too), so one code path moves every tensor to the device and dequantizes it there.

Shapes follow numpy order (the reverse of GGUF's `ne`): a matrix stored with ne = [in, out] has logical
shape (out, in) and bytes (out, row_bytes), row_bytes = in / block_size * type_size.

A model split by llama.cpp (gguf-split, or the converter's --split-max-tensors / --split-max-size) is
`NAME-00001-of-0000N.gguf` ... `NAME-0000N-of-0000N.gguf`, each shard a GGUF with `split.no` (0-based),
`split.count` and `split.tensors.count` (the total). Opening the first shard maps every shard and gives
one GGUFFile: metadata from the first, tensors from all, each tensor a view into its own shard's map.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from strata_jax.core.errors import ConfigError, GGUFFormatError, MissingTensorError
from strata_jax.core.paths import SHARD_NAME, shard_name
from strata_jax.gguf.layout import layout, row_bytes as _row_bytes

GGUF_MAGIC = b"GGUF"
FINGERPRINT_DATA_BYTES = 1 << 16  # tensor bytes GGUFFile.fingerprint hashes after each header


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape, numpy order
    data: np.ndarray  # uint8 [*shape[:-1], row_bytes], a view into the memory map of its shard
    shard: int = 0  # index of the file holding it (0 unless the model is split)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


_SCALAR = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


class _Cursor:
    """Sequential little-endian reads over the mapped header (gguf.GGUFReader builds a numpy array per
    vocabulary string, seconds for a large vocabulary: docs/benchmarks.md)."""

    def __init__(self, buf: np.ndarray):
        self.buf = buf
        self.mv = memoryview(buf)
        self.pos = 0

    def _take(self, n: int) -> memoryview:
        if self.pos + n > len(self.mv):
            raise GGUFFormatError("header ends early")
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self._take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self._take(8), "little")

    def string(self) -> str:
        n = self.u64()
        return str(self._take(n), "utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            sub = GGUFValueType(self.u32())
            count = self.u64()
            if sub == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if sub == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            dt = np.dtype(_SCALAR[sub])
            arr = np.frombuffer(self._take(count * dt.itemsize), dtype=dt).copy()
            return arr.astype(bool) if sub == GGUFValueType.BOOL else arr
        dt = np.dtype(_SCALAR[vtype])
        v = np.frombuffer(self._take(dt.itemsize), dtype=dt)[0]
        return bool(v) if vtype == GGUFValueType.BOOL else v.item()


def _read_header(buf: np.ndarray):
    c = _Cursor(buf)
    c._take(4)  # magic, checked by the caller
    version = c.u32()
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = c.u64(), c.u64()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.u32())
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.u32()
        ne = [c.u64() for _ in range(n_dims)]
        ggml_type = GGMLQuantizationType(c.u32())
        offset = c.u64()
        infos.append((name, tuple(reversed(ne)), ggml_type, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-c.pos // align) * align
    return version, metadata, infos, data_start


def shard_path(first: str, index: int, count: int) -> str | None:
    """The path of shard `index` (0-based) of `count` beside `first` (a -00001-of-N file); None if
    `first` does not carry a shard name."""
    m = SHARD_NAME.match(os.path.basename(first))
    if m is None:
        return None
    return os.path.join(os.path.dirname(first), shard_name(m['prefix'], index + 1, count))


class _Shard:
    """One GGUF file, mapped and its header parsed: the whole of an unsplit model, or one shard."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.exists(path):
            raise GGUFFormatError(f"{path}: no such file. Pass the path of a .gguf model file.")
        if os.path.isdir(path):
            raise GGUFFormatError(f"{path} is a directory; pass the path of a .gguf model file.")
        self.file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(
                f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r}). "
                "strata-jax reads GGUF only; convert safetensors with llama.cpp's convert_hf_to_gguf.py."
            )
        self.map = np.memmap(path, mode="r")
        try:
            self.version, self.metadata, self.infos, self.data_start = _read_header(self.map)
        except (ValueError, OverflowError, KeyError) as e:  # unknown enum values, bad lengths
            raise GGUFFormatError(
                f"{path}: corrupt or truncated GGUF header ({self.file_size:,} bytes on disk): {e}. "
                "Download the file again (a partial download looks like this)."
            ) from e
        except GGUFFormatError as e:
            raise GGUFFormatError(
                f"{path}: truncated GGUF: {e} ({self.file_size:,} bytes on disk). Download the file again."
            ) from None

    def split(self) -> tuple[int, int]:
        """(split.no, split.count); (0, 1) for a file that is not a shard."""
        return int(self.metadata.get("split.no", 0)), int(self.metadata.get("split.count", 1))

    def tensors(self, index: int):
        """This file's TensorInfos, views into its map, tagged with `index` (its place among the shards)."""
        for name, shape, ggml_type, offset in self.infos:
            block = layout(ggml_type).block_size
            if shape[-1] % block:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name!r} has {shape[-1]} columns, not a multiple of the "
                    f"{ggml_type.name} block ({block}); the file is corrupt."
                )
            row_bytes = _row_bytes(ggml_type, shape[-1])
            n_bytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
            begin = self.data_start + offset
            if begin + n_bytes > self.file_size:
                raise GGUFFormatError(
                    f"{self.path}: truncated: tensor {name!r} ends at byte {begin + n_bytes:,} but the file "
                    f"has {self.file_size:,}. Download the file again (a partial download looks like this)."
                )
            data = self.map[begin : begin + n_bytes].reshape(*shape[:-1], row_bytes)
            yield TensorInfo(name, ggml_type, shape, data, index)


def _open_shards(path: str) -> list[_Shard]:
    """The file at `path` and, if it is the first shard of a split model, every other shard, checked
    against each other the way llama.cpp's loader checks them."""
    first = _Shard(path)
    no, count = first.split()
    if no != 0:
        expected = shard_path(path, 0, count)
        where = (f"pass the first shard, {expected}" if expected else
                 f"pass the first shard (the one whose name ends -00001-of-{count:05d}.gguf)")
        raise GGUFFormatError(f"{path} is shard {no + 1} of {count} of a split model; {where}: opening it "
                              "loads every shard.")
    if count <= 1:
        return [first]
    m = SHARD_NAME.match(os.path.basename(path))
    if m is None or (int(m["no"]), int(m["count"])) != (1, count):
        raise GGUFFormatError(
            f"{path} is the first of {count} shards of a split model, but its name does not end "
            f"-00001-of-{count:05d}.gguf, so the other shards cannot be found: keep the names gguf-split or the "
            "converter gave them (NAME-00001-of-NNNNN.gguf ...), all in one directory.")
    shards = [first]
    for i in range(1, count):
        p = shard_path(path, i, count)
        if not os.path.isfile(p):
            raise GGUFFormatError(
                f"{path} is the first of {count} shards of a split model, but shard {i + 1} is missing: expected "
                f"{p}. Put every shard of the model in the same directory (download the missing one).")
        shard = _Shard(p)
        if shard.split() != (i, count):
            got_no, got_count = shard.split()
            raise GGUFFormatError(
                f"{p}: its split metadata says shard {got_no + 1} of {got_count} (split.no {got_no}, split.count "
                f"{got_count}), but it is named shard {i + 1} of the {count} of {path}: the shards come from "
                "different splits. Download or split the model again so that every shard comes from one run.")
        shards.append(shard)
    expected = first.metadata.get("split.tensors.count")
    found = sum(len(s.infos) for s in shards)
    if expected is not None and int(expected) != found:
        raise GGUFFormatError(
            f"{path}: split.tensors.count says the {count} shards hold {int(expected)} tensors, but they hold "
            f"{found} ({', '.join(str(len(s.infos)) for s in shards)}): a shard is from another split or corrupt. "
            "Download or split the model again so that every shard comes from one run.")
    return shards


class GGUFFile:
    """An open GGUF model: `metadata` (dict) and `tensors` (name -> TensorInfo), memory-mapped. `path`
    names one file, or the first shard of a split model, whose other shards are opened with it
    (`shard_paths`); `file_size` is the bytes of them all."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        shards = _open_shards(self.path)
        self.version, self.metadata = shards[0].version, shards[0].metadata
        self.shard_paths = tuple(s.path for s in shards)
        self.shard_sizes = tuple(s.file_size for s in shards)
        self.file_size = sum(self.shard_sizes)
        self._shards = shards
        self.tensors: dict[str, TensorInfo] = {}
        for i, shard in enumerate(shards):
            for t in shard.tensors(i):
                if t.name in self.tensors:
                    raise GGUFFormatError(
                        f"{shard.path}: tensor {t.name!r} is also in {self.shard_paths[self.tensors[t.name].shard]}: "
                        "the shards come from different splits. Download or split the model again.")
                self.tensors[t.name] = t

    @property
    def n_shards(self) -> int:
        return len(self.shard_paths)

    def fingerprint(self) -> str:
        """sha256 (hex) of every shard's header (metadata and tensor table) and the first bytes of its
        tensor data: tells this model apart from another file of the same name, size and tensor table
        (another fine-tune) while reading one page of weights."""
        h = hashlib.sha256()
        for shard in self._shards:
            h.update(shard.map[:shard.data_start + FINGERPRINT_DATA_BYTES].tobytes())
        return h.hexdigest()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing general.architecture>"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            close = difflib.get_close_matches(name, self.tensors.keys(), n=3)
            hint = f" Similar names in the file: {', '.join(close)}." if close else ""
            raise MissingTensorError(
                f"{self.path}: tensor {name!r} is missing for architecture {self.architecture!r}.{hint} "
                "The file may be from an unsupported variant or an incomplete conversion."
            ) from None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def file_span(self, name: str) -> tuple[str, int]:
        """(the path of the file holding tensor `name`, its first byte's offset there): for readers that
        read the bytes with pread instead of faulting the memory map in page by page."""
        t = self.tensor(name)
        shard = self._shards[t.shard]
        return shard.path, t.data.__array_interface__["data"][0] - shard.map.__array_interface__["data"][0]

    def __repr__(self) -> str:
        shards = f", shards={self.n_shards}" if self.n_shards > 1 else ""
        return f"GGUFFile({self.path!r}, arch={self.architecture!r}, tensors={len(self.tensors)}{shards})"


def metadata_view(metadata: Mapping[str, Any], arch: str):
    """Accessor for `{arch}.key` metadata with defaults: `m = metadata_view(md, 'qwen2'); m('block_count')`."""

    def get(key: str, default: Any = dataclasses.MISSING):
        full = f"{arch}.{key}"
        if full in metadata:
            return metadata[full]
        if default is dataclasses.MISSING:
            raise GGUFFormatError(f"metadata key {full!r} is missing; the GGUF is incomplete or not {arch}.")
        return default

    return get


def check_vocabulary(other, model, path: str, option: str, why: str) -> None:
    """A ConfigError unless GGUF `other`'s token list is `model`'s: a draft model (--spec draft:) or a
    low-bit copy (--cold-experts) must share the model's tokens. option, why: the flag and the consequence
    the message names."""
    mine, theirs = _tokens(other.metadata), _tokens(model.metadata)
    if mine != theirs:
        where = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        raise ConfigError(
            f"{option}{path}: its vocabulary differs from the model's ({len(mine):,} tokens against "
            f"{len(theirs):,}; first difference at token {where}), {why}")


def _tokens(metadata) -> list[str]:
    return list(metadata.get("tokenizer.ggml.tokens") or [])
