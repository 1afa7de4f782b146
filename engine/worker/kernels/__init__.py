"""CPU kernels in C: paged attention reading the KV cache in place, fused elementwise ops.

`build.py` compiles `csrc/*.c` into one shared library on first use and loads it with
ctypes; `attention.py` and `fused.py` are the torch-facing wrappers. Everything here is an
optional fast path: without a compiler (or with `APPLIANCE_CPU_KERNELS=off`, or
`runtime.cpu_kernels: false`) the engine runs the same math in plain torch.
"""
