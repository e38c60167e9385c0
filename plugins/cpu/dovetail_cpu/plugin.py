"""Registrations of the CPU plugin (cheap: imports nothing heavy)."""

from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_platforms(register):
    register(name="cpu", cls="dovetail_cpu.platform:CpuPlatform", probe="dovetail_cpu.cpu_info:probe", priority=0)


@hookimpl
def register_attention_backends(register):
    register(name="CPU_SIMD", cls="dovetail_cpu.attention:CpuSimdBackend", platforms=("cpu",), priority=10)
