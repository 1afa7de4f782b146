"""Benchmark scripts (see bench/README.md). A package so `bench.common` always resolves here."""
