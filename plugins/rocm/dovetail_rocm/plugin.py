"""Registrations of the ROCm plugin (cheap: imports nothing heavy)."""

from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_platforms(register):
    register(name="rocm", cls="dovetail_rocm.platform:RocmPlatform", probe="dovetail_rocm.probe:probe",
             priority=100)


@hookimpl
def register_attention_backends(register):
    register(name="ROCM_AITER", cls="dovetail_rocm.aiter_backend:RocmAiterBackend", platforms=("rocm",),
             priority=50)
