"""Train Dovetail's bundled default model: a small Llama that adds and subtracts integers.

The model answers prompts such as ``12+345=`` with ``357`` and ``12-345=`` with
``-333`` (operands of up to three digits), then ends with EOS. Everything is
made here: the character-level tokenizer (with a chat template), the training
data (generated on the fly, never touching the held-out problems) and the
weights, trained with transformers' own ``LlamaForCausalLM`` on the CPU and
saved with ``save_pretrained`` (safetensors) into
``core/dovetail/assets/bundled-model``. The run is seeded and uses one torch
thread, so the same torch version on the same kind of CPU rebuilds the same
model bit for bit (it reaches about 98-99% on held-out problems).

    python scripts/train_bundled_model.py            # about 20 minutes (6000 steps, 1 thread)
    python scripts/train_bundled_model.py --steps 50 --out /tmp/quick   # a quick smoke run
    python scripts/train_bundled_model.py --evaluate  # the saved model's accuracy, no training

A problem is held out (never trained on) when :func:`is_held_out` says so; the
accuracy printed at the end, and the one the tests measure, is on those. They
are drawn as the training problems are: each operand has 1, 2 or 3 digits,
equally likely, so most problems are shorter than with operands uniform in
0-999 (``--evaluate`` reports both).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a shared machine spinning made 2 threads 7x slower than 1.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

SEED = 0
MAX_OPERAND = 999
OPERATORS = ("+", "-")

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]
CHARACTERS = list("0123456789+-= \n") + list("abcdefghijklmnopqrstuvwxyz") + list("*/().,?")

# The model answers one question at a time: BOS, the last user message (with "=" added when it lacks one),
# and, when an assistant message follows it, that answer and EOS. System messages and earlier turns are dropped.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set turn = namespace(question='', answer=none) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{% set turn.question = message['content'] | trim %}{% set turn.answer = none %}"
    "{% elif message['role'] == 'assistant' %}"
    "{% set turn.answer = message['content'] | trim %}"
    "{% endif %}"
    "{% endfor %}"
    "{{ turn.question }}{% if not turn.question.endswith('=') %}={% endif %}"
    "{% if turn.answer is not none %}{{ turn.answer }}{{ eos_token }}{% endif %}"
)

MODEL_DIR = Path(__file__).resolve().parents[1] / "core" / "dovetail" / "assets" / "bundled-model"


# -- data ------------------------------------------------------------------------------------


def sample_operand(rng: random.Random) -> int:
    """A number of 1, 2 or 3 digits (each length equally likely), so short numbers are common too."""
    digits = rng.randint(1, 3)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def sample_problem(rng: random.Random) -> tuple[int, str, int]:
    return sample_operand(rng), rng.choice(OPERATORS), sample_operand(rng)


def is_held_out(a: int, op: str, b: int) -> bool:
    """One problem in 16, chosen by a fixed hash: never trained on, used to measure accuracy."""
    key = (a * (MAX_OPERAND + 1) + b) * 2 + OPERATORS.index(op)
    return ((key * 2654435761) % 2**32 >> 16) % 16 == 0


def answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def prompt_text(a: int, op: str, b: int) -> str:
    return f"{a}{op}{b}="


def sample_uniform_problem(rng: random.Random) -> tuple[int, str, int]:
    """Operands uniform in 0-999 (nine in ten have three digits): harder than the training distribution."""
    return rng.randint(0, MAX_OPERAND), rng.choice(OPERATORS), rng.randint(0, MAX_OPERAND)


def held_out_problems(count: int, seed: int, sampler=sample_problem) -> list[tuple[int, str, int]]:
    """``count`` distinct held-out problems drawn by ``sampler`` (default: the training distribution)."""
    rng = random.Random(seed)
    found: dict[tuple[int, str, int], None] = {}
    while len(found) < count:
        problem = sampler(rng)
        if is_held_out(*problem):
            found[problem] = None
    return list(found)


# -- tokenizer -------------------------------------------------------------------------------


def build_tokenizer():
    """A character-level tokenizer: BOS is added to every encoded text; unknown characters map to <unk>."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                   pad_token=PAD, clean_up_tokenization_spaces=False, model_max_length=256)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, out: Path) -> None:
    """Save with the chat template inside ``tokenizer_config.json`` and a class name every transformers knows."""
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def encode_example(tokenizer, problem: tuple[int, str, int], length: int) -> tuple[list[int], list[int]]:
    """Token ids ``<s> a op b = answer </s> <pad>...`` and labels that score only the answer and EOS."""
    prompt = tokenizer(prompt_text(*problem)).input_ids
    target = tokenizer(str(answer(*problem)), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ids = prompt + target
    pad = length - len(ids)
    return ids + [tokenizer.pad_token_id] * pad, [-100] * len(prompt) + target + [-100] * pad


def training_batch(tokenizer, rng: random.Random, size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = [], []
    while len(ids) < size:
        problem = sample_problem(rng)
        if is_held_out(*problem):
            continue
        x, y = encode_example(tokenizer, problem, length)
        ids.append(x)
        labels.append(y)
    return torch.tensor(ids), torch.tensor(labels)


# -- model -----------------------------------------------------------------------------------


def model_config(tokenizer, hidden: int, layers: int, intermediate: int, head_dim: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                       num_key_value_heads=hidden // head_dim,
                       max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.02,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"])


@torch.no_grad()
def greedy_answers(model, tokenizer, problems: list[tuple[int, str, int]], max_new_tokens: int = 6) -> list[str]:
    """Greedy completions (text up to EOS), batched by prompt length so no padding is needed."""
    prompts = [tokenizer(prompt_text(*p)).input_ids for p in problems]
    results: list[str] = [""] * len(problems)
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    for indices in by_length.values():
        ids = torch.tensor([prompts[i] for i in indices])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        for i, row in zip(indices, out[:, ids.shape[1]:].tolist()):
            results[i] = tokenizer.decode(row, skip_special_tokens=True)
    return results


def accuracy(model, tokenizer, problems: list[tuple[int, str, int]]) -> float:
    got = greedy_answers(model, tokenizer, problems)
    return sum(text == str(answer(*p)) for text, p in zip(got, problems)) / len(problems)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(model_config(tokenizer, args.hidden, args.layers, args.intermediate, args.head_dim))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers, hidden {args.hidden}, {params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98))
    probe = held_out_problems(256, seed=SEED + 1)
    start, cpu_start = time.monotonic(), time.process_time()
    model.train()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        ids, labels = training_batch(tokenizer, rng, args.batch_size, args.seq_len)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            model.eval()
            acc = accuracy(model, tokenizer, probe)
            model.train()
            print(f"step {step + 1}/{args.steps}  loss {loss.item():.4f}  probe accuracy {acc:.3f}  "
                  f"{time.monotonic() - start:.0f}s (cpu {time.process_time() - cpu_start:.0f}s)", flush=True)
    model.eval()
    seconds, cpu_seconds = time.monotonic() - start, time.process_time() - cpu_start

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out)
    held_out = held_out_problems(args.eval_size, seed=SEED + 2)
    acc = accuracy(model, tokenizer, held_out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"trained in {seconds:.0f}s (cpu {cpu_seconds:.0f}s); held-out accuracy {acc:.4f} on {len(held_out)} problems; "
          f"{size / 1e6:.2f} MB written to {out}")


def evaluate(args: argparse.Namespace) -> None:
    """The accuracy of the model saved at ``--out`` on held-out problems of both distributions."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    model = LlamaForCausalLM.from_pretrained(args.out).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out)
    for name, sampler in (("training distribution (1-3 digits equally likely)", sample_problem),
                          ("operands uniform in 0-999", sample_uniform_problem)):
        problems = held_out_problems(args.eval_size, seed=SEED + 2, sampler=sampler)
        print(f"held-out accuracy {accuracy(model, tokenizer, problems):.4f} on {len(problems)} problems, {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(MODEL_DIR), help="model directory to write")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=14, help="longest example, <s>100-999=-899</s>, is 14 tokens")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (at most 2 here); the saved model was trained with 1")
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--eval-size", type=int, default=2000)
    parser.add_argument("--evaluate", action="store_true", help="measure the model at --out; do not train")
    args = parser.parse_args()
    evaluate(args) if args.evaluate else train(args)


if __name__ == "__main__":
    main()
