"""A private protobuf descriptor pool for the `inference` (KServe v2) stubs and reflection.

tritonclient registers Triton's full `inference` package in protobuf's default pool. Our
wire-compatible subset defines the same symbols from another file, which the default pool
refuses once both are imported (a test process, a bench driving both). So the generated
`inference` module adds its file here instead (see `build_proto.py`), and server reflection
serves from this pool, into which `reflection_pool()` also copies the other services' files.
"""

from __future__ import annotations

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()


def reflection_pool(*file_descriptors: object) -> descriptor_pool.DescriptorPool:
    """POOL, with the given modules' `DESCRIPTOR`s (health, reflection, appliance.v1) added.

    Adding a file that is already there with identical contents is a no-op, so calling this
    once per server start is safe.
    """
    for fd in file_descriptors:
        POOL.AddSerializedFile(fd.serialized_pb)  # type: ignore[attr-defined]
    return POOL
