"""The core's own built-ins, registered through the same hooks as any plugin."""

from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_attention_backends(register):
    register(name="REFERENCE", cls="dovetail.attention.reference:ReferenceBackend", platforms=("*",), priority=-100)
    register(name="TRITON", cls="dovetail.attention.triton_backend:TritonBackend",
             platforms=("cuda", "rocm", "xpu"), priority=0)


@hookimpl
def register_quantization_methods(register):
    register(name="none", cls="dovetail.quantization.unquantized:UnquantizedMethod")
    register(name="fp8", cls="dovetail.quantization.fp8:Fp8Method")
    register(name="int8", cls="dovetail.quantization.int8:Int8Method")
    register(name="gptq", cls="dovetail.quantization.gptq:GptqMethod")
    register(name="awq", cls="dovetail.quantization.awq:AwqMethod")
    register(name="compressed-tensors", cls="dovetail.quantization.compressed_tensors:CompressedTensorsMethod")
