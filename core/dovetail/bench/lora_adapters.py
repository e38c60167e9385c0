"""Random LoRA adapters at a model's shapes, in PEFT's file layout, for benchmarks of adapter serving."""

from __future__ import annotations

import json
import os

import torch

def _projections(config) -> dict[str, tuple[int, int]]:
    """Each projection of a Llama-style decoder layer: (input size, output size) from the HF config."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = config.intermediate_size
    return {"self_attn.q_proj": (hidden, heads * head_dim), "self_attn.k_proj": (hidden, kv),
            "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (heads * head_dim, hidden),
            "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}


def random_adapters(config, count: int, rank: int, directory: str, seed: int = 0) -> list:
    """``count`` adapters of ``rank`` on every attention and MLP projection of a dense Llama-style model,
    written under ``directory``; their :class:`~dovetail.lora.LoRARequest` (ids 1 to ``count``)."""
    from safetensors.torch import save_file

    from dovetail.lora import LoRARequest

    generator = torch.Generator().manual_seed(seed)
    projections = _projections(config)
    requests = []
    for index in range(1, count + 1):
        path = os.path.join(directory, f"adapter-{index}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for name, (inputs, outputs) in projections.items():
                prefix = f"base_model.model.model.layers.{layer}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) * inputs ** -0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * 0.01
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
                  os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                       "target_modules": sorted({n.split(".")[-1] for n in projections})}, f)
        requests.append(LoRARequest(f"adapter-{index}", index, path))
    return requests
