"""The benchmarks of docs/benchmarks.md: ``dovetail bench throughput|latency|serve``."""
