"""Registrations of the model zoo: HF architecture name -> implementation (lazy)."""

from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"

ARCHITECTURES = {
    "LlamaForCausalLM": "dovetail_models.llama:LlamaForCausalLM",
}


@hookimpl
def register_models(register):
    for architecture, cls in ARCHITECTURES.items():
        register(architecture=architecture, cls=cls)
