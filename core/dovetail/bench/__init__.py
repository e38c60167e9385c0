"""Benchmarks of BENCHMARKS.md: ``dovetail bench throughput|latency|serve``."""
