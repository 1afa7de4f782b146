"""The gRPC frontend: the native `appliance.v1` service and KServe v2 / Triton compatibility.

Kept import-light on purpose: the generated stubs under `proto/` import `appliance.grpc`
as a package, so this module must not import the server (and grpc) itself.
"""
