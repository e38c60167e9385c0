"""Entry point of the plugin: declares the contract range and registers everything lazily."""

from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_platforms(register):
    # Below the CPU's priority (0), so auto-selection keeps the CPU; `--device toy` selects it.
    register(name="toy", cls="acme_dovetail.platform:ToyPlatform", probe="acme_dovetail.probe:probe",
             priority=-10)


@hookimpl
def register_attention_backends(register):
    register(name="TOY_ATTN", cls="acme_dovetail.attention:ToyAttentionBackend", platforms=("toy",))


@hookimpl
def register_quantization_methods(register):
    register(name="toy_int8", cls="acme_dovetail.quant:ToyInt8Method")


@hookimpl
def register_models(register):
    register(architecture="AcmeForCausalLM", cls="acme_dovetail.model:AcmeForCausalLM")
