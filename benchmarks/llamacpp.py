#!/usr/bin/env python3
"""llama.cpp as the peer engine for `strata-jax bench`: pack its sources, build llama-bench, run it.

Standalone, standard library only: it runs with a bare `python3` on the GPU box, where only the repo
copy (and .gpu/llama-src.tar.xz, carried next to it) exists and nothing can be downloaded.

    pack   --sdist PATH --out .gpu/llama-src.tar.xz
        Copy from the llama-cpp-python sdist (the .tar.gz or its extracted directory) only the parts
        of vendor/llama.cpp that llama-bench needs (ggml base + CPU + CUDA backends, src, include,
        common, vendor, cmake, tools/llama-bench) into a tar.xz, about 2.1 MiB (770 files,
        19 MiB unpacked; the same sdist always packs to the same bytes). tools/CMakeLists.txt is
        replaced by a three-line one of ours that adds only llama-bench (the original adds every
        tool). LLAMA_PEER.json at the top of the archive records the llama.cpp commit (from the
        sdist's CHANGELOG), the llama-cpp-python version and the sdist's sha256.
    build  --src .gpu/llama-src.tar.xz --dir /tmp/llama [--cpu-only] [-j N]
        Unpack into DIR/llama.cpp, configure with cmake + ninja (CUDA, sm_90 by default) into
        DIR/build and build llama-bench: DIR/build/bin/llama-bench (LLAMA_BUILD_COMMIT is set from the
        manifest, so llama-bench's JSON names the commit). Skipped when that binary exists (a note
        if DIR/build/LLAMA_PEER.stamp names another archive); --force rebuilds.
    run    --bin DIR/build/bin/llama-bench --model FILE.gguf --placement all-gpu,cpu-experts,budget
           [--budget-gib 32] [--n-prompt 512] [--n-gen 128] [--reps 3] [--threads N] --out results.json
        One llama-bench run (`-o json`) per placement; rows as in `strata-jax bench`:
        {"engine": "llama.cpp", "placement", "gpu_expert_layers", "decode_tok_s", "prefill_tok_s",
         "n_prompt", "command", ...}.
    plan   --model FILE.gguf --budget-gib 32
        Print the budget computation only (no llama-bench needed).

Placements (this llama-bench accepts both `-ot/--override-tensor PATTERN=BUFT` and
`-ncmoe/--n-cpu-moe N`; the latter adds `blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps` -> CPU for
i < N, i.e. the routed experts of the first N blocks stay in host memory):
    all-gpu      -ngl 99                      everything on the GPU
    cpu-experts  -ngl 99 -ncmoe <n_layers>    all routed experts on the CPU (same as -ot exps=CPU)
    budget       -ngl 99 -ncmoe N             the smallest N (largest GPU share of expert layers)
                                              whose GPU footprint fits --budget-gib:
        dense_gpu + sum(expert bytes of blocks >= N) + margin <= budget
    where dense_gpu = every tensor but the routed experts and token_embd (llama.cpp keeps the input
    embedding on the host; a tied output matrix is counted once more, as llama.cpp copies it to the
    GPU), and margin = KV cache (f16 K and V for n_ctx = n_prompt + n_gen, padded to 256)
                     + compute buffers (estimated 4 * n_ubatch * (n_vocab + 8 * d_model) bytes: logits
                       plus activations of one ubatch)
                     + --overhead-gib (default 1.0: CUDA context, cuBLAS workspace, pool slack).
    Tensor bytes come from the GGUF header (offset differences, so every GGML type is sized without a
    type table). All runs use flash attention (`-fa 1`), `-ub 512` and `-t` threads (default: all
    cores); placements with experts on the host also `-lm none` (load into RAM rather than mmap: llama.cpp
    warns that CPU tensor overrides with mmap are slower; --load-mode overrides).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import mmap
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path

GiB = 1024**3
MiB = 1024**2

# --------------------------------------------------------------------------------------------------
# pack

# Paths under vendor/llama.cpp/ that llama-bench needs: directories (every file below) and files.
PACK_DIRS = (
    "cmake/", "include/", "src/", "common/", "vendor/", "licenses/", "tools/llama-bench/",
    "ggml/cmake/", "ggml/include/", "ggml/src/ggml-cpu/", "ggml/src/ggml-cuda/",
)
PACK_FILES = ("CMakeLists.txt", "LICENSE", "ggml/CMakeLists.txt")
PACK_TOP_FILES_OF = ("ggml/src/",)  # files directly in these directories, no subdirectories
TOOLS_CMAKELISTS = b"""\
# Written by strata-jax benchmarks/llamacpp.py (the original adds every tool): llama-bench only.
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
"""
ARCHIVE_ROOT = "llama.cpp"
MANIFEST = "LLAMA_PEER.json"


def _wanted(rel: str) -> bool:
    if rel in PACK_FILES or any(rel.startswith(d) for d in PACK_DIRS):
        return True
    return any(rel.startswith(d) and "/" not in rel[len(d):] for d in PACK_TOP_FILES_OF)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _changelog_commit(text: str, version: str | None) -> str | None:
    """The llama.cpp commit of the sdist's version, from llama-cpp-python's CHANGELOG.md
    ("## [0.3.36]" ... "update llama.cpp to ggml-org/llama.cpp@0c1e57098")."""
    sections = re.split(r"^## ", text, flags=re.M)
    for sec in sections:
        if version and not sec.startswith(f"[{version}]"):
            continue
        m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", sec)
        if m:
            return m.group(1)
        if version:
            return None
    return None


def _sdist_members(sdist: Path):
    """Yields (rel path under vendor/llama.cpp, bytes getter, mode, mtime) and the sdist's metadata."""
    meta: dict = {}
    if sdist.is_file():
        tf = tarfile.open(sdist, "r:*")
        members = tf.getmembers()
        root = next((m.name[: -len("CMakeLists.txt")] for m in members
                     if m.name.endswith("vendor/llama.cpp/CMakeLists.txt")), None)
        if root is None:
            raise SystemExit(f"{sdist}: no vendor/llama.cpp/CMakeLists.txt inside")
        top = root[: -len("vendor/llama.cpp/")]
        for m in members:
            if m.name in (top + "PKG-INFO", top + "CHANGELOG.md") and m.isfile():
                meta[m.name[len(top):]] = tf.extractfile(m).read().decode("utf-8", "replace")
        files = [(m.name[len(root):], (lambda m=m: tf.extractfile(m).read()), m.mode, m.mtime)
                 for m in members if m.isfile() and m.name.startswith(root)]
        return files, meta
    root = sdist
    if (sdist / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        root = sdist / "vendor" / "llama.cpp"
        for name in ("PKG-INFO", "CHANGELOG.md"):
            if (sdist / name).exists():
                meta[name] = (sdist / name).read_text("utf-8", "replace")
    elif not (sdist / "ggml" / "CMakeLists.txt").exists():
        raise SystemExit(f"{sdist}: neither an sdist directory nor a llama.cpp source tree")
    files = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                files.append((p.relative_to(root).as_posix(), p.read_bytes, st.st_mode & 0o777, int(st.st_mtime)))
    return files, meta


def cmd_pack(args) -> int:
    sdist = Path(args.sdist)
    out = Path(args.out)
    files, meta = _sdist_members(sdist)
    version = None
    m = re.search(r"^Version:\s*(\S+)", meta.get("PKG-INFO", ""), flags=re.M)
    if m:
        version = m.group(1)
    manifest = {
        "llama_cpp_python_version": version,
        "llama_cpp_commit": _changelog_commit(meta.get("CHANGELOG.md", ""), version),
        "sdist": sdist.name,
        "sdist_sha256": _sha256(sdist) if sdist.is_file() else None,
        "replaced": {"tools/CMakeLists.txt": "llama-bench only (written by benchmarks/llamacpp.py)"},
        "files": 0,
        "bytes_uncompressed": 0,
    }
    chosen = sorted((f for f in files if _wanted(f[0])), key=lambda f: f[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    t0 = time.time()
    summary: dict[str, list[int]] = {}

    def add(tf, rel, data, mode, mtime):
        ti = tarfile.TarInfo(f"{ARCHIVE_ROOT}/{rel}")
        ti.size, ti.mode, ti.mtime = len(data), mode or 0o644, int(mtime)
        tf.addfile(ti, io.BytesIO(data))

    with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, \
            tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for rel, read, mode, mtime in chosen:
            data = read()
            add(tf, rel, data, mode, mtime)
            manifest["files"] += 1
            manifest["bytes_uncompressed"] += len(data)
            dirs = rel.split("/")[:-1][: 3 if rel.startswith("ggml/src/") else 2]
            s = summary.setdefault("/".join(dirs) or ".", [0, 0])
            s[0] += 1
            s[1] += len(data)
        when = max((f[3] for f in chosen), default=0)  # fixed times: the same sdist packs to the same bytes
        add(tf, "tools/CMakeLists.txt", TOOLS_CMAKELISTS, 0o644, when)
        add(tf, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode(), 0o644, when)
    tmp.replace(out)
    size = out.stat().st_size
    for key in sorted(summary):
        n, b = summary[key]
        print(f"  {key:<40} {n:5d} files {b / MiB:7.2f} MiB")
    print(json.dumps(manifest, indent=1))
    print(f"wrote {out}: {size / MiB:.2f} MiB ({size} bytes), {manifest['files']} files, "
          f"{manifest['bytes_uncompressed'] / MiB:.1f} MiB unpacked, in {time.time() - t0:.0f} s")
    if size > 20 * MiB:
        print("WARNING: over 20 MiB", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------------
# build


def cmd_build(args) -> int:
    src = Path(args.src).resolve()
    d = Path(args.dir).resolve()
    bdir = d / "build"
    binary = bdir / "bin" / "llama-bench"
    stamp = bdir / "LLAMA_PEER.stamp"
    want = f"{_sha256(src)} cpu_only={args.cpu_only} arch={args.cuda_arch}"
    if binary.exists() and not args.force:
        have = stamp.read_text().strip() if stamp.exists() else "an unrecorded build"
        print(f"{binary} exists ({have}); skipping the build (--force rebuilds)")
        if have != want:
            print(f"note: that is not {want}", file=sys.stderr)
        return 0
    tree = d / ARCHIVE_ROOT
    if tree.exists():
        shutil.rmtree(tree)
    d.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src, "r:xz") as tf:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(d, **kw)
    manifest = json.loads((tree / MANIFEST).read_text())
    commit = manifest.get("llama_cpp_commit") or "unknown"
    cfg = ["cmake", "-S", str(tree), "-B", str(bdir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
           f"-DLLAMA_BUILD_COMMIT={commit}", "-DLLAMA_BUILD_NUMBER=0"]
    if args.cpu_only:
        cfg += ["-DGGML_CUDA=OFF"]
    else:
        cfg += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={args.cuda_arch}"]
        if not shutil.which("nvcc"):
            for cand in ("/usr/local/cuda/bin/nvcc",):
                if os.path.exists(cand):
                    cfg.append(f"-DCMAKE_CUDA_COMPILER={cand}")
    cfg += args.cmake_arg or []
    t0 = time.time()
    print("+ " + shlex.join(cfg), flush=True)
    subprocess.run(cfg, check=True)
    t1 = time.time()
    build = ["ninja", "-C", str(bdir), f"-j{args.jobs}", "llama-bench"]
    print("+ " + shlex.join(build), flush=True)
    subprocess.run(build, check=True)
    t2 = time.time()
    stamp.write_text(want + "\n")
    print(f"built {binary}: configure {t1 - t0:.0f} s, build {t2 - t1:.0f} s, total {t2 - t0:.0f} s "
          f"(llama.cpp {commit}, {'CPU only' if args.cpu_only else 'CUDA sm_' + args.cuda_arch})")
    return 0


# --------------------------------------------------------------------------------------------------
# GGUF header (standard library only)

_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")  # llama.cpp's LLM_FFN_EXPS_REGEX
KEEP_ARRAYS = ("tokenizer.ggml.tokens",)  # arrays whose length we need; other arrays are skipped


def read_gguf_header(path: str | os.PathLike) -> dict:
    """{'metadata': {key: value} (arrays: their length only, as {'array_len': n}), 'tensors':
    [{'name', 'shape' (GGUF ne order), 'type', 'offset', 'nbytes'}], 'data_offset', 'file_size'}."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 0

        def take(fmt):
            nonlocal pos
            v = struct.unpack_from(fmt, mm, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string():
            nonlocal pos
            n = take("<Q")
            s = mm[pos : pos + n].decode("utf-8", "replace")
            pos += n
            return s

        def skip_value(vt):
            nonlocal pos
            if vt == _STRING:
                pos += 8 + struct.unpack_from("<Q", mm, pos)[0]
            elif vt == _ARRAY:
                et, n = take("<I"), take("<Q")
                if et in _FIXED:
                    pos += n * struct.calcsize(_FIXED[et])
                else:
                    for _ in range(n):
                        skip_value(et)
            else:
                pos += struct.calcsize(_FIXED[vt])

        if mm[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        pos = 4
        version = take("<I")
        n_tensors, n_kv = take("<Q"), take("<Q")
        meta: dict = {"GGUF.version": version}
        for _ in range(n_kv):
            key = string()
            vt = take("<I")
            if vt == _STRING:
                meta[key] = string()
            elif vt == _ARRAY:
                start = pos
                et, n = take("<I"), take("<Q")
                if et in _FIXED and n <= 4096:  # small numeric arrays (per-layer head counts) in full
                    fmt = _FIXED[et]
                    meta[key] = [take(fmt) for _ in range(n)]
                else:
                    pos = start
                    skip_value(vt)
                    meta[key] = {"array_len": n}
            else:
                meta[key] = take(_FIXED[vt])
        tensors = []
        for _ in range(n_tensors):
            name = string()
            nd = take("<I")
            shape = [take("<Q") for _ in range(nd)]
            ttype, off = take("<I"), take("<Q")
            tensors.append({"name": name, "shape": shape, "type": ttype, "offset": off})
        align = int(meta.get("general.alignment", 32))
        data_offset = (pos + align - 1) // align * align
        file_size = len(mm)
    order = sorted(range(len(tensors)), key=lambda i: tensors[i]["offset"])
    for j, i in enumerate(order):
        end = tensors[order[j + 1]]["offset"] if j + 1 < len(order) else file_size - data_offset
        tensors[i]["nbytes"] = end - tensors[i]["offset"]  # includes <= alignment-1 bytes of padding
    return {"metadata": meta, "tensors": tensors, "data_offset": data_offset, "file_size": file_size}


def _scalar(meta, key, default=None):
    v = meta.get(key, default)
    if isinstance(v, list):
        return max(v) if v else default
    return v


def model_footprint(header: dict) -> dict:
    """GPU-relevant byte counts of a GGUF: per-block routed-expert bytes, dense bytes that llama.cpp
    puts on the GPU with -ngl 99, and the shape numbers for the KV cache/compute margin."""
    meta, tensors = header["metadata"], header["tensors"]
    arch = meta.get("general.architecture", "")
    n_layers = int(meta.get(f"{arch}.block_count", 0))
    expert_bytes = [0] * n_layers
    dense_gpu = host_only = 0
    names = {t["name"] for t in tensors}
    for t in tensors:
        m = EXPS_RE.match(t["name"])
        if m:
            i = int(m.group(1))
            if i >= len(expert_bytes):
                expert_bytes += [0] * (i + 1 - len(expert_bytes))
            expert_bytes[i] += t["nbytes"]
        elif t["name"] == "token_embd.weight":
            host_only += t["nbytes"]
            if "output.weight" not in names:  # tied: llama.cpp puts a copy on the output layer's device
                dense_gpu += t["nbytes"]
        else:
            dense_gpu += t["nbytes"]
    d_model = int(_scalar(meta, f"{arch}.embedding_length", 0))
    n_head = int(_scalar(meta, f"{arch}.attention.head_count", 1) or 1)
    n_kv = int(_scalar(meta, f"{arch}.attention.head_count_kv", n_head) or n_head)
    k_len = int(_scalar(meta, f"{arch}.attention.key_length", d_model // n_head))
    v_len = int(_scalar(meta, f"{arch}.attention.value_length", d_model // n_head))
    vocab = meta.get("tokenizer.ggml.tokens")
    n_vocab = vocab["array_len"] if isinstance(vocab, dict) else int(_scalar(meta, f"{arch}.vocab_size", 0) or 0)
    return {
        "arch": arch, "n_layers": n_layers, "expert_bytes": expert_bytes, "dense_gpu_bytes": dense_gpu,
        "host_only_bytes": host_only, "d_model": d_model, "n_kv_heads": n_kv, "key_length": k_len,
        "value_length": v_len, "n_vocab": n_vocab, "n_experts": int(_scalar(meta, f"{arch}.expert_count", 0) or 0),
        "file_size": header["file_size"],
    }


def margin_bytes(fp: dict, n_ctx: int, n_ubatch: int = 512, overhead_gib: float = 1.0) -> dict:
    n_ctx_pad = (n_ctx + 255) // 256 * 256
    kv = 2 * fp["n_layers"] * n_ctx_pad * fp["n_kv_heads"] * (fp["key_length"] + fp["value_length"])  # f16
    compute = 4 * n_ubatch * (fp["n_vocab"] + 8 * fp["d_model"])
    overhead = int(overhead_gib * GiB)
    return {"kv_cache": kv, "compute": compute, "overhead": overhead, "total": kv + compute + overhead}


def plan_budget(fp: dict, budget_bytes: int, n_ctx: int, n_ubatch: int = 512, overhead_gib: float = 1.0) -> dict:
    """The smallest n_cpu_moe N (experts of blocks 0..N-1 on the host) whose GPU footprint fits."""
    margin = margin_bytes(fp, n_ctx, n_ubatch, overhead_gib)
    eb = fp["expert_bytes"]
    moe_blocks = [i for i, b in enumerate(eb) if b]
    total_exp = sum(eb)
    fixed = fp["dense_gpu_bytes"] + margin["total"]
    n_cpu_moe, fits = len(eb), False
    for n in range(len(eb) + 1):
        if fixed + sum(eb[n:]) <= budget_bytes:
            n_cpu_moe, fits = n, True
            break
    gpu_exp = sum(eb[n_cpu_moe:])
    return {
        "budget_bytes": budget_bytes, "n_cpu_moe": n_cpu_moe, "fits": fits,
        "gpu_expert_layers": sum(1 for i in moe_blocks if i >= n_cpu_moe), "moe_layers": len(moe_blocks),
        "gpu_expert_bytes": gpu_exp, "expert_bytes_total": total_exp,
        "gpu_expert_fraction": gpu_exp / total_exp if total_exp else 0.0,
        "dense_gpu_bytes": fp["dense_gpu_bytes"], "margin": margin,
        "gpu_bytes_estimate": fixed + gpu_exp,
    }


# --------------------------------------------------------------------------------------------------
# run


def parse_bench_json(text: str) -> dict:
    """llama-bench `-o json` output -> {'prefill': row|None, 'decode': row|None, 'build': {...}}."""
    rows = json.loads(text)
    out: dict = {"prefill": None, "decode": None, "build": {}, "rows": rows}
    for r in rows:
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            out["prefill"] = r
        elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            out["decode"] = r
    if rows:
        r = rows[0]
        out["build"] = {k: r.get(k) for k in ("build_commit", "build_number", "backends", "cpu_info", "gpu_info")}
        out["model"] = {k: r.get(k) for k in ("model_filename", "model_type", "model_size", "model_n_params")}
    return out


def placement_flags(placement: str, fp: dict, plan: dict | None) -> tuple[list[str], int]:
    """llama-bench flags for a placement and the n_cpu_moe they mean."""
    if placement == "all-gpu":
        return ["-ngl", "99"], 0
    if placement == "cpu-experts":
        n = len(fp["expert_bytes"])
        return ["-ngl", "99", "-ncmoe", str(n)], n
    if placement == "budget":
        n = plan["n_cpu_moe"]
        return ["-ngl", "99", "-ncmoe", str(n)], n
    raise ValueError(f"unknown placement {placement!r}")


def depth_flags(depth: int, cache_type: str) -> list[str]:
    """llama-bench's -d (prefill and decode after `depth` tokens already in the KV cache, as strata-jax's bench
    decodes after its prompt) and -ctk/-ctv for a KV type other than f16 ("q8_0", or "K,V")."""
    k, _, v = cache_type.partition(",")
    return (["-d", str(depth)] if depth else []) + (["-ctk", k, "-ctv", v or k] if cache_type != "f16" else [])


def load_mode_flags(load_mode: str, n_cpu_moe: int) -> list[str]:
    """'auto': `-lm none` when some experts stay on the host (llama.cpp warns that CPU tensor overrides
    with mmap are slower and suggests --load-mode none), llama-bench's default (mmap) otherwise."""
    if load_mode == "auto":
        return ["-lm", "none"] if n_cpu_moe > 0 else []
    return ["-lm", load_mode]


def make_row(placement: str, parsed: dict, fp: dict, n_cpu_moe: int, cmd: list[str], args, plan=None) -> dict:
    moe_blocks = [i for i, b in enumerate(fp["expert_bytes"]) if b]
    gpu_exp = sum(fp["expert_bytes"][n_cpu_moe:])
    total = sum(fp["expert_bytes"])
    pre, dec = parsed["prefill"], parsed["decode"]
    row = {
        "engine": "llama.cpp", "placement": placement,
        "gpu_expert_layers": sum(1 for i in moe_blocks if i >= n_cpu_moe), "moe_layers": len(moe_blocks),
        "n_cpu_moe": n_cpu_moe, "gpu_expert_fraction": gpu_exp / total if total else 0.0,
        "decode_tok_s": dec["avg_ts"] if dec else None, "decode_tok_s_std": dec["stddev_ts"] if dec else None,
        "prefill_tok_s": pre["avg_ts"] if pre else None, "prefill_tok_s_std": pre["stddev_ts"] if pre else None,
        "n_prompt": pre["n_prompt"] if pre else args.n_prompt, "n_gen": dec["n_gen"] if dec else args.n_gen,
        "reps": args.reps, "n_threads": (dec or pre or {}).get("n_threads"),
        "flash_attn": (dec or pre or {}).get("flash_attn"), "load_mode": (dec or pre or {}).get("load_mode"),
        "depth": getattr(args, "depth", 0), "cache_type": getattr(args, "cache_type", "f16"),
        "command": shlex.join(cmd), "build": parsed["build"], "model": str(args.model),
        "model_size": parsed.get("model", {}).get("model_size"),
    }
    if plan is not None:
        row["budget_gib"] = plan["budget_bytes"] / GiB
        row["budget_plan"] = plan
    return row


def cmd_plan(args) -> int:
    fp = model_footprint(read_gguf_header(args.model))
    plan = plan_budget(fp, int(args.budget_gib * GiB), args.n_prompt + args.n_gen + args.depth, args.n_ubatch,
                       args.overhead_gib)
    print(json.dumps({"footprint": fp, "plan": plan}, indent=1))
    return 0


def cmd_run(args) -> int:
    fp = model_footprint(read_gguf_header(args.model))
    if not any(fp["expert_bytes"]):
        print(f"note: {args.model} has no routed-expert tensors; cpu-experts/budget equal all-gpu", file=sys.stderr)
    placements = [p for ps in args.placement for p in ps.split(",") if p]
    plan = plan_budget(fp, int(args.budget_gib * GiB), args.n_prompt + args.n_gen + args.depth, args.n_ubatch,
                       args.overhead_gib)
    rows = []
    out = Path(args.out)
    if args.append and out.exists():
        rows = json.loads(out.read_text())
    for placement in placements:
        flags, ncmoe = placement_flags(placement, fp, plan)
        cmd = [args.bin, "-m", str(args.model), "-p", str(args.n_prompt), "-n", str(args.n_gen),
               "-r", str(args.reps), "-ub", str(args.n_ubatch), "-fa", "1", "-t", str(args.threads),
               *flags, *load_mode_flags(args.load_mode, ncmoe), *depth_flags(args.depth, args.cache_type), "-o", "json",
               *(args.extra or [])]
        if placement == "budget":
            print(f"budget {args.budget_gib} GiB -> n_cpu_moe {plan['n_cpu_moe']} "
                  f"({plan['gpu_expert_layers']}/{plan['moe_layers']} expert layers on the GPU, estimate "
                  f"{plan['gpu_bytes_estimate'] / GiB:.2f} GiB{'' if plan['fits'] else ', DOES NOT FIT'})",
                  file=sys.stderr)
        print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            tail = proc.stderr[-3000:]
            print(f"llama-bench failed (rc {proc.returncode}):\n{tail}", file=sys.stderr)
            rows.append({"engine": "llama.cpp", "placement": placement, "n_cpu_moe": ncmoe,
                         "command": shlex.join(cmd), "error": f"rc {proc.returncode}", "stderr_tail": tail})
            continue
        parsed = parse_bench_json(proc.stdout)
        row = make_row(placement, parsed, fp, ncmoe, cmd, args, plan if placement == "budget" else None)
        row["wall_s"] = round(wall, 1)
        if args.raw:
            row["raw"] = parsed["rows"]
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("placement", "gpu_expert_layers", "n_cpu_moe", "prefill_tok_s",
                                              "decode_tok_s")}), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out} ({len(rows)} rows)", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) else 1


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="sdist -> llama-bench sources as tar.xz")
    a.add_argument("--sdist", required=True, help="llama_cpp_python-*.tar.gz or its extracted directory")
    a.add_argument("--out", default=".gpu/llama-src.tar.xz")
    a.set_defaults(fn=cmd_pack)
    a = sub.add_parser("build", help="unpack + cmake + ninja llama-bench")
    a.add_argument("--src", default=".gpu/llama-src.tar.xz")
    a.add_argument("--dir", default="/tmp/llama")
    a.add_argument("--cpu-only", action="store_true")
    a.add_argument("--cuda-arch", default="90")
    a.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 4)
    a.add_argument("--force", action="store_true")
    a.add_argument("--cmake-arg", action="append", help="extra -D... for cmake (repeatable)")
    a.set_defaults(fn=cmd_build)
    for name, fn in (("run", cmd_run), ("plan", cmd_plan)):
        a = sub.add_parser(name)
        if name == "run":
            a.add_argument("--bin", default="/tmp/llama/build/bin/llama-bench")
            a.add_argument("--placement", action="append", required=True,
                           help="all-gpu | cpu-experts | budget (comma list or repeated)")
            a.add_argument("--reps", type=int, default=3)
            a.add_argument("--threads", type=int, default=os.cpu_count() or 16)
            a.add_argument("--out", required=True)
            a.add_argument("--append", action="store_true", help="add rows to an existing --out")
            a.add_argument("--load-mode", default="auto",
                           help="llama-bench -lm: auto (none when experts are on the host, else mmap) | none | mmap | ...")
            a.add_argument("--raw", action="store_true", help="keep llama-bench's JSON rows in each row")
            a.add_argument("--extra", nargs=argparse.REMAINDER, help="further llama-bench arguments (last)")
        a.add_argument("--model", required=True)
        a.add_argument("--budget-gib", type=float, default=32.0)
        a.add_argument("--n-prompt", type=int, default=512)
        a.add_argument("--n-gen", type=int, default=128)
        a.add_argument("--n-ubatch", type=int, default=512)
        a.add_argument("--overhead-gib", type=float, default=1.0)
        a.add_argument("--depth", type=int, default=0, help="llama-bench -d: tokens already in the KV cache (the "
                                                             "budget plan's context includes them)")
        a.add_argument("--cache-type", default="f16", help="KV type: f16, q8_0, q4_0 or K,V (llama-bench -ctk/-ctv)")
        a.set_defaults(fn=fn)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
