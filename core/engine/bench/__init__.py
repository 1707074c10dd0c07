"""Benchmarks: a load generator for a running server and an offline throughput run."""
