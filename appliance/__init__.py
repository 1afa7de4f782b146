"""The product: CLI, config loading, HTTP and gRPC frontends, telemetry, metrics."""
