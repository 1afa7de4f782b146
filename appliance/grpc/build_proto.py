"""Regenerates the committed Python stubs from the .proto files (`make proto`).

The stubs are committed so that installing and running the appliance needs no code
generation step; `tests/serving/test_grpc_proto.py` regenerates them into a temporary directory
and fails if they differ from the committed ones, so a .proto edit without `make proto`
cannot land. Generation is pinned to the grpcio-tools version in pyproject.toml because its
output embeds the protobuf and grpc versions it was made with.

    python -m appliance.grpc.build_proto            # rewrite the stubs in the tree
    python -m appliance.grpc.build_proto --out DIR  # write them under DIR instead
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The repository root: protoc runs with it as the include path, so each file's registered
# name is its path in the tree and the stubs import each other as `appliance.grpc.proto...`.
ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = Path(__file__).resolve().parent / "proto"
PROTOS = (
    "appliance/grpc/proto/appliance/v1/appliance.proto",
    "appliance/grpc/proto/inference/grpc_service.proto",
)
# Stubs whose descriptors go to the private pool (see proto/_pool.py for why).
PRIVATE_POOL_STUBS = ("appliance/grpc/proto/inference/grpc_service_pb2.py",)
_DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_PRIVATE_POOL = "DESCRIPTOR = _POOL.AddSerializedFile("
_IMPORTS_MARK = "# @@protoc_insertion_point(imports)\n"
_POOL_IMPORT = "from appliance.grpc.proto._pool import POOL as _POOL\n"


def generated_files() -> list[str]:
    """Paths (relative to the root) of every stub `generate` writes."""
    out = []
    for proto in PROTOS:
        stem = proto.removesuffix(".proto")
        out += [f"{stem}_pb2.py", f"{stem}_pb2_grpc.py"]
    return out


def _use_private_pool(path: Path) -> None:
    text = path.read_text()
    if _DEFAULT_POOL not in text or _IMPORTS_MARK not in text:
        raise RuntimeError(f"{path}: unexpected generated code; update build_proto.py")
    text = text.replace(_DEFAULT_POOL, _PRIVATE_POOL)
    text = text.replace(_IMPORTS_MARK, _IMPORTS_MARK + _POOL_IMPORT, 1)
    path.write_text(text)


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Runs protoc (from grpcio-tools) on every .proto; returns the files written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(ROOT / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    for rel in PRIVATE_POOL_STUBS:
        _use_private_pool(out_dir / rel)
    return [out_dir / rel for rel in generated_files()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write the stubs under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
