"""Registrations of the XPU plugin (cheap: imports nothing heavy)."""

from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_platforms(register):
    register(name="xpu", cls="dovetail_xpu.platform:XpuPlatform", probe="dovetail_xpu.probe:probe", priority=100)
