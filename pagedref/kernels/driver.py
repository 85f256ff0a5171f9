"""The CUDA driver's launch with attributes, through ctypes: what CuPy's RawKernel cannot ask for.

One idea: two things a kernel launch here needs, CuPy's launcher does not pass:
  - programmatic dependent launch (PDL), a launch attribute of the driver's cuLaunchKernelEx: a kernel that
    may start while the one before it on the stream is still running, and waits for it in the kernel
    (`griddepcontrol.wait`) before reading what it wrote (decode v3's reduce, as a candidate);
  - by-value arguments of any size (the 128-byte TMA descriptors, encoded here: the GEMM's operands, the
    KV pools of prefill v3's TMA schedule).
A launch goes on the given stream exactly as a CuPy launch would, so torch orders it and a CUDA graph
captures it (with its attributes: a captured PDL launch becomes a programmatic edge of the graph).
Tried and not kept (docs/benchmarks.md, 2026-12-02): every kernel of the decode step that is the project's
own launched so, each waiting for the one before in the kernel. The bits held and the step's time did not
move: inside a graph the launches already follow each other closely.

Invariant: every argument is passed as the ctypes value of the kernel parameter's own type (a device
pointer as uint64, int as int32, float as float32); a failed launch raises with the driver's error code.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
_PREFERRED_SHARED_MEMORY_CARVEOUT = 14  # (cuda.h of CUDA 13; takes precedence over the function's attribute)


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint32 * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def lib():
    """libcuda with the prototypes this package calls (the launch and the TMA encoding here)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    cuda.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                                            u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    cuda.cuTensorMapEncodeTiled.restype = ctypes.c_int
    cuda.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    cuda.cuLaunchKernelEx.restype = ctypes.c_int
    return cuda


_TMA_DTYPES = {"float16": 6, "float32": 7, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_*
SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B: 16-byte chunk c of a 128-byte row r at c ^ (r % 8)
_L2_PROMOTION_256B = 3


class TmaMap(ctypes.Structure):  # CUtensorMap: 128 opaque bytes (a kernel parameter, copied at launch)
    _fields_ = [("w", ctypes.c_uint64 * 16)]


@functools.lru_cache(maxsize=4096)
def tensor_map(ptr: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...], dtype: str,
               swizzle: int) -> TmaMap:
    """The TMA descriptor of a tensor at ptr: `dims` innermost first (elements), the byte `strides` of the
    outer ones, read or written in boxes of `box` elements; dtype by name ("bfloat16"). Its bytes depend
    only on these arguments, so a cached one is right for any tensor with them (the weights, the KV pools)."""
    scratch = ctypes.create_string_buffer(128 + 64)  # the driver writes a 64-byte aligned CUtensorMap
    aligned = (ctypes.addressof(scratch) + 63) & ~63
    rank = len(dims)
    rc = lib().cuTensorMapEncodeTiled(
        aligned, _TMA_DTYPES[dtype], rank, ctypes.c_void_p(ptr), (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*[1] * rank),
        0, swizzle, _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for dims {dims}, box {box}, {dtype}")
    m = TmaMap()
    ctypes.memmove(ctypes.addressof(m), aligned, 128)
    return m


_CTYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float}


def _value(arg):
    """A kernel argument as a ctypes value: ctypes values as they are, numpy scalars by their dtype."""
    if isinstance(arg, (ctypes._SimpleCData, ctypes.Structure)):
        return arg
    if isinstance(arg, np.generic) and arg.dtype in _CTYPES:
        return _CTYPES[arg.dtype](arg.item())
    raise TypeError(f"a kernel argument must be a ctypes value or a numpy uint64/int64/int32/float32 scalar, "
                    f"got {type(arg).__name__}")


def launch(kernel, grid: tuple[int, ...], block: int, args, stream: int, *, shared_mem: int = 0,
           pdl: bool = False, carveout: int | None = None) -> None:
    """Launch `kernel` (a cupy RawKernel) on `stream` (a CUstream handle), in the current device's context.
    pdl: this launch may begin before the previous kernel on the stream ends (the kernel must
    griddepcontrol.wait before its dependent reads, in every CTA). carveout: the percentage of the SM's
    shared memory capacity this launch prefers as shared memory (the rest is L1); a hint, per launch."""
    values = [_value(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attrs = []
    if pdl:
        attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        attrs.append(attr)
    if carveout is not None:
        attr = _Attribute(id=_PREFERRED_SHARED_MEMORY_CARVEOUT)
        attr.value[0] = carveout
        attrs.append(attr)
    array = (_Attribute * max(len(attrs), 1))(*attrs)
    grid3 = (*grid, 1, 1)[:3]
    config = _Config((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(block, 1, 1), shared_mem, stream,
                     array, len(attrs))
    rc = lib().cuLaunchKernelEx(ctypes.byref(config), kernel.kernel.ptr, params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx({getattr(kernel, 'name', 'kernel')}) failed with CUresult {rc} (grid {grid3}, block {block}, "
                           f"pdl {pdl}, carveout {carveout})")
