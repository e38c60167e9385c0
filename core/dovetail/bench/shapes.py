"""Named benchmark shapes (docs/benchmarks.md), built as HF configs with dummy weights."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    """A named model shape: its HF config factory and the dtype it is measured in."""

    name: str
    dtype: str
    description: str

    def config(self):
        from transformers import LlamaConfig, Qwen3MoeConfig

        if self.name == "qwen3-0.6b":
            return _qwen3(hidden=1024, layers=28, heads=16, intermediate=3072, tied=True)
        if self.name == "qwen3-32b":
            return _qwen3(hidden=5120, layers=64, heads=64, intermediate=25600, tied=False)
        if self.name == "llama-3.1-8b":
            return _llama3(hidden=4096, layers=32, heads=32, intermediate=14336)
        if self.name == "llama-3.1-70b":
            return _llama3(hidden=8192, layers=80, heads=64, intermediate=28672)
        if self.name in ("qwen3-moe-15b-a3b", "qwen3-30b-a3b"):
            # Qwen3-30B-A3B's layer; the 15B shape keeps half of its 48 layers.
            return Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=24 if self.name == "qwen3-moe-15b-a3b" else 48,
                                  num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                  norm_topk_prob=True, intermediate_size=6144, vocab_size=151936,
                                  tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
                                  rms_norm_eps=1e-6, architectures=["Qwen3MoeForCausalLM"])
        if self.name == "c1":
            return LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                               intermediate_size=1376, vocab_size=32000, max_position_embeddings=2048,
                               rms_norm_eps=1e-6, architectures=["LlamaForCausalLM"])
        raise KeyError(self.name)


def _qwen3(hidden: int, layers: int, heads: int, intermediate: int, tied: bool):
    """A dense Qwen3 of 8 KV heads of 128 and Qwen3's vocabulary, RoPE and norm."""
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                       head_dim=128, intermediate_size=intermediate, vocab_size=151936, tie_word_embeddings=tied,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       architectures=["Qwen3ForCausalLM"])


def _llama3(hidden: int, layers: int, heads: int, intermediate: int):
    """A Llama 3.1 of 8 KV heads, with its vocabulary and its scaled RoPE over 131,072 positions."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                       intermediate_size=intermediate, vocab_size=128256, rope_theta=500000.0,
                       max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       architectures=["LlamaForCausalLM"])


SHAPES = {
    "qwen3-0.6b": Shape("qwen3-0.6b", "bfloat16", "Qwen3 0.6B shape (B1/B2 on GPUs)"),
    "llama-3.1-8b": Shape("llama-3.1-8b", "bfloat16", "Llama 3.1 8B shape (B1/B2 on GPUs)"),
    "qwen3-32b": Shape("qwen3-32b", "bfloat16", "Qwen3 32B shape (B1/B2 with tensor parallelism)"),
    "llama-3.1-70b": Shape("llama-3.1-70b", "bfloat16", "Llama 3.1 70B shape (B1/B2 with tensor parallelism)"),
    "qwen3-moe-15b-a3b": Shape("qwen3-moe-15b-a3b", "bfloat16",
                               "Qwen3-30B-A3B's layers, 24 of them: 128 experts, 8 per token (B1/B2 on GPUs)"),
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", "bfloat16", "Qwen3-30B-A3B shape: 48 MoE layers (B1/B2 on GPUs)"),
    "c1": Shape("c1", "float32", "small Llama of C1/C2 (CPU)"),
}


def synthetic_tokenizer(directory: str | Path, vocab_size: int, seed: int = 0):
    """Save a byte-level BPE tokenizer of ``vocab_size`` tokens (the last one ``<|endoftext|>``) in ``directory``.

    Named shapes have no tokenizer of their own, and nothing may be downloaded; what needs one (structured
    outputs compile grammars against the vocabulary) gets this stand-in. Its merges are drawn with a fixed
    seed so that most tokens are pieces of words, numbers and punctuation, as in a trained vocabulary.
    """
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    common = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") * 4 + list("0123456789") + ["Ġ"] * 10 \
        + list(".,:;\"'(){}[]-_/") + ["Ċ", "ĉ"]  # byte-level spellings of space, newline and tab
    pool, merges = list(common), []
    while len(vocab) < vocab_size - 1:
        left, right = rng.choice(pool) if rng.random() < 0.7 else rng.choice(common), rng.choice(common)
        if left + right in vocab or len(left) >= 16:
            continue
        merges.append((left, right))
        vocab[left + right] = len(vocab)
        pool.append(left + right)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(str(directory))
    return fast


def materialize(model: str, with_tokenizer: bool = False) -> tuple[str, dict]:
    """A model directory for ``model`` and the engine defaults it implies.

    A named shape becomes a temporary directory holding only ``config.json``
    (and, if asked, a :func:`synthetic_tokenizer`), loaded with
    ``load_format="dummy"``; anything else is passed through.
    """
    shape = SHAPES.get(model)
    if shape is None:
        return model, {}
    directory = Path(tempfile.mkdtemp(prefix=f"dovetail-{shape.name}-"))
    config = shape.config()
    config.dtype = shape.dtype
    if with_tokenizer:
        fast = synthetic_tokenizer(directory, config.vocab_size)
        config.eos_token_id = fast.eos_token_id
    config.save_pretrained(str(directory))
    return str(directory), {"load_format": "dummy", "dtype": shape.dtype}


def projections(config) -> dict[str, tuple[int, int]]:
    """(N, K) of one layer's merged projections, of the LM head and, for mixtures of experts, of the router."""
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    shapes = {"qkv": (q + 2 * kv, config.hidden_size), "o": (config.hidden_size, q),
              "gate_up": (2 * config.intermediate_size, config.hidden_size),
              "down": (config.hidden_size, config.intermediate_size),
              "lm_head": (config.vocab_size, config.hidden_size)}
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        shapes["router"] = (experts, config.hidden_size)
    return shapes
