"""Tiny random HF models and local tokenizers for tests (nothing is downloaded).

Models are built with transformers' own classes and saved with
``save_pretrained`` (safetensors), so Dovetail loads exactly what HF runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "café naïve résumé — 你好，世界 😀 emoji and accents",
    "1 + 2 = 3; 12 + 30 = 42; 7 * 6 = 42",
    "def f(x):\n    return x * 2\n",
    "The engine schedules requests, caches prefixes and samples tokens.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(path: str | Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on a small fixed corpus, saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def save_model(path: str | Path, config, seed: int = 0, max_shard_size: str | None = None,
               tokenizer: bool = True, dtype: torch.dtype = torch.float32) -> Path:
    """Build ``AutoModelForCausalLM.from_config(config)`` with a fixed seed and save it (and a tokenizer)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    if tokenizer:
        build_tokenizer(path, vocab_size=min(300, config.vocab_size))
    return path


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    values.update(overrides)
    return LlamaConfig(**values)


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF ``generate`` greedy tokens (EOS ignored) and the log-softmax of each step's logits."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return tokens, logprobs


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def assert_greedy_matches(ours: list[int], theirs: list[int], hf_logprobs: list[torch.Tensor], tol: float = 1e-4):
    """Tokens must be identical, except where HF's top two logits tie within ``tol`` (then either is right,
    and the comparison stops there because the continuations legitimately differ)."""
    i = first_divergence(ours, theirs)
    if i is None:
        return
    if i < len(hf_logprobs):
        lp = hf_logprobs[i]
        top2 = lp.topk(2).values
        if ours[i] in lp.topk(2).indices.tolist() and float(top2[0] - top2[1]) < tol:
            return
    gap = ""
    if i < len(hf_logprobs) and i < len(ours) and i < len(theirs):
        lp = hf_logprobs[i]
        gap = f" (HF's logprobs there: ours {float(lp[ours[i]]):.6f}, HF's {float(lp[theirs[i]]):.6f})"
    raise AssertionError(f"greedy tokens diverge at step {i}: ours {ours[i:i + 5]} vs HF {theirs[i:i + 5]}{gap}")


def completions(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each request's greedy tokens and, per step, its top log-probabilities (plain data, picklable)."""
    return [(list(out.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()}
                                              for step in out.outputs[0].logprobs]) for out in outputs]


def check_matches(completed, expected, tol: float = 1e-4):
    """Greedy tokens equal to ``expected``'s (the comparison stops at a near tie of its top two), and
    the log-probabilities of every token both report within ``tol``."""
    for (tokens, logprobs), (want, want_logprobs) in zip(completed, expected):
        for step, (token, wanted) in enumerate(zip(tokens, want)):
            for tid, lp in want_logprobs[step].items():
                if tid in logprobs[step]:
                    assert abs(logprobs[step][tid] - lp) < tol, f"step {step}, token {tid}"
            if token != wanted:
                top2 = sorted(want_logprobs[step].values(), reverse=True)[:2]
                assert token in want_logprobs[step] and top2[0] - top2[1] < tol, \
                    f"greedy tokens diverge at step {step}: {tokens[step:step + 5]} vs {want[step:step + 5]}"
                break
        assert len(tokens) == len(want)


#: A chat template in the manner of Hermes/Qwen: tools in a system turn, assistant tool calls as
#: ``<tool_call>`` blocks, tool results as ``<tool_response>``, and ``enable_thinking=False`` closing an
#: empty reasoning in the generation prompt (as Qwen3's template does).
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|><tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools></s>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined and m.tool_calls %}<|assistant|>{{ m.content or '' }}"
    "{%- for call in m.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}</s>"
    "{%- elif m.role == 'tool' %}<|tool|><tool_response>{{ m.content }}</tool_response></s>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}</s>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def save_scripted_model(path: str | Path, script: list[str], start: str = "<|assistant|>",
                        chat_template: str = TOOL_CHAT_TEMPLATE) -> Path:
    """A tiny Llama that, after the token ``start``, says ``script`` and then EOS, whatever came before.

    ``start`` and every piece of ``script`` become tokens of their own (added, not special). Each token of
    the chain ``start, *script, EOS`` gets a direction of the hidden space as its embedding; the layers'
    output projections are zero, so the last hidden state is the current token's embedding, and the LM
    head maps each direction to the next token of the chain with a large logit. A piece that also follows
    another token of the chain (``script`` must not repeat a piece) continues the script from there.
    """
    from tokenizers import AddedToken
    from transformers import LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(path)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in [start, *script]])
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    chain = [tokenizer.convert_tokens_to_ids(t) for t in [start, *script]] + [tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "every piece of the script must be a distinct token"
    config = tiny_llama_config(vocab_size=320)
    assert len(tokenizer) <= config.vocab_size and len(chain) <= config.hidden_size
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for i, (token, following) in enumerate(zip(chain, chain[1:])):
            embed[token].zero_()
            embed[token, i] = 1.0
            head[following].zero_()
            head[following, i] = 10.0
    model.save_pretrained(str(path))
    return path
