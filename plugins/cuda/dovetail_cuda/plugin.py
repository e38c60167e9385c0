"""Registrations of the CUDA plugin (cheap: imports neither torch.cuda nor any kernel library)."""

from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_platforms(register):
    register(name="cuda", cls="dovetail_cuda.platform:CudaPlatform", probe="dovetail_cuda.probe:probe",
             priority=100)


@hookimpl
def register_attention_backends(register):
    register(name="FLASH_ATTN", cls="dovetail_cuda.flash_attn_backend:FlashAttnBackend", platforms=("cuda",),
             priority=60)
    register(name="FLASHINFER", cls="dovetail_cuda.flashinfer_backend:FlashInferBackend", platforms=("cuda",),
             priority=50)
