"""Registrations of the model zoo: HF architecture name -> implementation (lazy)."""

from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"

ARCHITECTURES = {
    "LlamaForCausalLM": "dovetail_models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "dovetail_models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "dovetail_models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "dovetail_models.qwen3:Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM": "dovetail_models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "dovetail_models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "dovetail_models.mixtral:MixtralForCausalLM",
    "Gemma2ForCausalLM": "dovetail_models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "dovetail_models.gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "dovetail_models.phi3:Phi3ForCausalLM",
    "GemmaForCausalLM": "dovetail_models.gemma:GemmaForCausalLM",
    "GraniteForCausalLM": "dovetail_models.granite:GraniteForCausalLM",
    "SmolLM3ForCausalLM": "dovetail_models.smollm3:SmolLM3ForCausalLM",
    "Olmo2ForCausalLM": "dovetail_models.olmo2:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "dovetail_models.olmo2:Olmo3ForCausalLM",
    "SeedOssForCausalLM": "dovetail_models.seed_oss:SeedOssForCausalLM",
    "Starcoder2ForCausalLM": "dovetail_models.starcoder2:Starcoder2ForCausalLM",
    "Exaone4ForCausalLM": "dovetail_models.exaone4:Exaone4ForCausalLM",
    "ArceeForCausalLM": "dovetail_models.arcee:ArceeForCausalLM",
}


@hookimpl
def register_models(register):
    for architecture, cls in ARCHITECTURES.items():
        register(architecture=architecture, cls=cls)
