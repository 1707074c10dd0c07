"""Spreading one model over several devices and processes (tensor parallelism for now)."""
