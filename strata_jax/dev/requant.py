"""A GGUF's routed experts requantized to another GGML type (gguf-py's quantizers), everything else as it
was: the low-bit copy of a model for --cold-experts when no such file exists (a converter-made tiny model,
a synthetic one). gguf-py quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (no IQ types).

    python -m strata_jax.dev.requant IN.gguf OUT.gguf Q4_0
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from strata_jax.model.memory import is_routed_expert

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # what gguf-py's quantize() writes
ARCH_KEY = "general.architecture"
FILE_TYPE_KEY = "general.file_type"  # the source's type no longer says what the experts are: left out


def requantize_experts(src: str | Path, dst: str | Path, qtype: str) -> Path:
    """Write `dst`: `src` (one file) with every routed expert tensor dequantized and quantized again to
    `qtype`; metadata and the other tensors copied as they are. Returns dst."""
    if qtype.upper() not in QUANTIZABLE:
        raise ValueError(f"requantize to {qtype!r}: gguf-py quantizes only {', '.join(QUANTIZABLE)}")
    target = GGMLQuantizationType[qtype.upper()]
    reader = GGUFReader(str(src))
    arch = reader.fields[ARCH_KEY].contents()
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == ARCH_KEY or field.name.startswith("GGUF.") or field.name == FILE_TYPE_KEY:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if is_routed_expert(t.name) and t.tensor_type != target:
            vals = gguf_quants.dequantize(data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, gguf_quants.quantize(vals, target), raw_dtype=target)
        elif t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python -m strata_jax.dev.requant IN.gguf OUT.gguf QTYPE")
    try:
        print(requantize_experts(*sys.argv[1:]))
    except (ValueError, OSError) as e:
        sys.exit(f"strata_jax.dev.requant: {e}")
