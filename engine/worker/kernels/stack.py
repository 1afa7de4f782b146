"""The decoder-stack kernel (csrc/decoder_stack.c) from Python: its three structs and the call.

`StackLayer`, `StackModel` and `StackStep` mirror the C structs field for field (ctypes lays
them out as the C compiler does); engine/worker/models/cpu_stack.py fills them from a model
and a step. `run` returns the C function's status (0 = done).
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int64, c_void_p

from engine.worker.kernels.build import library

LINEARS = 4  # qkv, o, gate_up, down
AMX_BF16_KIND = 32  # csrc/decoder_stack.c: a bf16 weight in csrc/amx_linear.c's tile layout


class StackLayer(ctypes.Structure):
    _fields_ = [
        ("ln1", c_void_p),
        ("ln2", c_void_p),
        ("eps1", c_float),
        ("eps2", c_float),
        ("w", c_void_p * LINEARS),
        ("kind", c_int * LINEARS),
        ("bias", c_void_p * LINEARS),
        ("kv_cache", c_void_p),
        ("window", c_int),
    ]


class StackModel(ctypes.Structure):
    _fields_ = [
        ("n_layers", c_int64),
        ("hidden", c_int64),
        ("heads", c_int64),
        ("kv_heads", c_int64),
        ("head_dim", c_int64),
        ("inter", c_int64),
        ("block_size", c_int64),
        ("bf16", c_int),
        ("scale", c_float),
        ("cos", c_void_p),
        ("sin", c_void_p),
        ("layers", POINTER(StackLayer)),
    ]


class StackStep(ctypes.Structure):
    _fields_ = [
        ("T", c_int64),
        ("res", c_void_p),
        ("out", c_void_p),
        ("positions", c_void_p),
        ("slots", c_void_p),
        ("block_tables", c_void_p),
        ("bt_stride", c_int64),
        ("q_rows", c_void_p),
        ("reqs", c_void_p),
        ("pos", c_void_p),
        ("n_items", c_int64),
        ("work", c_void_p),
    ]


def workspace_bytes(model: StackModel, rows: int) -> int:
    """Scratch bytes a step of `rows` rows needs (activations, fp32 rows, block sums)."""
    return int(library().decoder_stack_workspace(ctypes.byref(model), rows))


def run(model: StackModel, step: StackStep, num_threads: int) -> int:
    return int(library().decoder_stack(ctypes.byref(model), ctypes.byref(step), num_threads))
