"""Minimal safetensors reader/writer (numpy only; torch optional).

Debian does not ship python3-safetensors, so this implements the format
directly:

    [8 bytes]  little-endian u64 N = length of the JSON header
    [N bytes]  JSON: {"name": {"dtype": "F32", "shape": [..],
                               "data_offsets": [begin, end]}, ...,
                      "__metadata__": {"key": "value", ...}}   (str -> str)
               padded with spaces so that 8 + N is a multiple of 8
    [rest]     raw little-endian tensor bytes; offsets are relative to here

Supported dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL.
BF16 has no numpy dtype: it is read as raw uint16 bits; `load_numpy`
upcasts it to float32 (exact) unless keep_bf16_bits=True.
"""

import json
import struct

import numpy as np

_NP_OF = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_ST_OF = {
    np.dtype("<f8"): "F64",
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<i4"): "I32",
    np.dtype("<i2"): "I16",
    np.dtype("i1"): "I8",
    np.dtype("u1"): "U8",
    np.dtype("?"): "BOOL",
}


def bf16_bits_to_f32(bits):
    """uint16 bf16 bit patterns -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x):
    """float32 -> bf16 bit patterns, round to nearest even (NaN kept NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = 0x7FC0
    return out


def read_header(path):
    """Returns (header dict without __metadata__, metadata dict, data start offset)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise ValueError(f"{path}: header length {n} is implausible")
        header = json.loads(f.read(n).decode("utf-8"))
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata, 8 + n


def load_numpy(path, keep_bf16_bits=False):
    """Returns ({name: np.ndarray}, metadata, {name: dtype string})."""
    header, metadata, start = read_header(path)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    tensors, dtypes = {}, {}
    for name, info in header.items():
        dt = info["dtype"]
        if dt not in _NP_OF:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        npdt = _NP_OF[dt]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if e - b != count * npdt.itemsize or e > len(data):
            raise ValueError(f"{path}: tensor {name}: data_offsets {b}..{e} do not fit "
                             f"shape {list(shape)} of {dt} (data is {len(data)} bytes)")
        arr = np.frombuffer(data, dtype=npdt, count=count, offset=b).reshape(shape).copy()
        if dt == "BF16" and not keep_bf16_bits:
            arr = bf16_bits_to_f32(arr)
        tensors[name] = arr
        dtypes[name] = dt
    return tensors, metadata, dtypes


def save_numpy(path, tensors, metadata=None, dtypes=None):
    """Writes {name: np.ndarray} in insertion order.

    dtypes may map a name to "BF16" to store a float32 array as bf16
    (rounded to nearest even) or to mark a uint16 array as raw bf16 bits.
    metadata values are converted to str (the format requires str -> str).
    """
    dtypes = dtypes or {}
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        want = dtypes.get(name)
        if want == "BF16":
            bits = arr if arr.dtype == np.uint16 else f32_to_bf16_bits(arr)
            blob, dt = np.ascontiguousarray(bits, dtype="<u2").tobytes(), "BF16"
        else:
            le = arr.dtype.newbyteorder("<")
            if le not in _ST_OF:
                raise ValueError(f"tensor {name}: unsupported numpy dtype {arr.dtype}")
            dt = _ST_OF[le]
            if want is not None and want != dt:
                raise ValueError(f"tensor {name}: asked for {want} but array is {dt}")
            blob = np.ascontiguousarray(arr, dtype=le).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((8 - (8 + len(hbytes)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for blob in blobs:
            f.write(blob)


# ---- torch helpers (imported lazily so the module works without torch) ----

def load_torch(path):
    """Returns ({name: torch.Tensor}, metadata). BF16 stays torch.bfloat16."""
    import torch
    arrays, metadata, dtypes = load_numpy(path, keep_bf16_bits=True)
    out = {}
    for name, arr in arrays.items():
        if dtypes[name] == "BF16":
            out[name] = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(arr)
    return out, metadata


def save_torch(path, tensors, metadata=None):
    """Writes {name: torch.Tensor}; bfloat16 tensors are stored as BF16."""
    import torch
    arrays, dtypes = {}, {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            arrays[name] = t.view(torch.int16).numpy().view(np.uint16)
            dtypes[name] = "BF16"
        else:
            arrays[name] = t.numpy()
    save_numpy(path, arrays, metadata, dtypes)
