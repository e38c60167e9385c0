"""Quantized checkpoints in the layouts their tools write, loaded through ``LLM`` like any model.

The reference quantisers below are written for these tests, independently of
``dovetail.quantization``: they turn a tiny random Llama saved by transformers
into the tensors and ``quantization_config`` of AutoFP8, transformers'
FineGrainedFP8 (its own quantizer op), llm-compressor's compressed-tensors
(FP8 and INT8 W8A8), AutoGPTQ/GPTQModel (v1 and v2 zero points, act-order) and
AutoAWQ (GEMM packing). GPTQ's error-compensating search is not reproduced:
round-to-nearest gives tensors in the same format, which is what is tested.

Checks per format:

- layer: every quantized linear layer, loaded, computes ``x @ W_ref.T`` where
  ``W_ref`` is the test's own dequantisation of the tensors it wrote (error bound
  ``LAYER_BOUND``, relative to the output's largest magnitude);
- model, against HF transformers running ``W_ref`` in float32: weight-only formats
  (GPTQ, AWQ) give HF's greedy tokens, log-probabilities within 1e-3; W8A8 formats,
  teacher-forced on HF's greedy tokens, rank at least ``MIN_TOP1`` of them first
  with a mean log-probability difference under ``MAX_DLOGPROB`` (activation
  quantization is the only difference);
- model, against the original float model: at least ``MIN_TOP1_VS_FLOAT`` of its
  greedy tokens ranked first (quantization noise, not a mis-read layout).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from dovetail import LLM, SamplingParams
from dovetail.errors import ConfigError, ModelLoadError, SelectionError

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Modules that read the same input share GPTQ's act-order permutation.
SAME_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in",
              "up_proj": "mlp_in", "o_proj": "o_proj", "down_proj": "down_proj"}

# -- reference quantisers: (float weight [N, K]) -> checkpoint tensors and the dequantised weight -----


def fp8_per_tensor(w):
    scale = w.abs().max().float() / 448.0
    q = (w.float() / scale).clamp(-448, 448).to(FP8)
    return q, scale, q.float() * scale


def fp8_per_channel(w):
    scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
    q = (w.float() / scale).clamp(-448, 448).to(FP8)
    return q, scale, q.float() * scale


def int8_per_channel(w):
    scale = w.abs().amax(dim=1, keepdim=True).float() / 127.0
    q = torch.round(w.float() / scale).clamp(-128, 127).to(torch.int8)
    return q, scale, q.float() * scale


def int4_rtn(w, g_idx, groups, sym):
    """GPTQ/AWQ-style 4-bit round-to-nearest per (output row, group): q, zero, scale [N, G] and W_ref."""
    n = w.shape[0]
    zeros = torch.zeros(n, groups)
    scales = torch.zeros(n, groups)
    q = torch.zeros_like(w, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        block = w[:, cols].float()
        if sym:
            xmax = block.abs().amax(1).clamp(min=1e-8)
            scale, zero = 2 * xmax / 15, torch.full((n,), 8.0)
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            zero = torch.round(-lo / scale)
        scale = scale.half().float()  # checkpoints store float16 scales
        q[:, cols] = torch.clamp(torch.round(block / scale[:, None]) + zero[:, None], 0, 15).long()
        zeros[:, g], scales[:, g] = zero, scale
    ref = (q.float() - zeros[:, g_idx]) * scales[:, g_idx]
    return q, zeros.long(), scales, ref


def pack_rows(values, order=range(8)):
    """int32 words of 8 nibbles along dim 0: field i of word r holds row 8r + order[i]."""
    v = values.long()
    words = torch.zeros(v.shape[0] // 8, *v.shape[1:], dtype=torch.int64)
    for i, pos in enumerate(order):
        words |= (v[pos::8] & 0xF) << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_cols(values, order=range(8)):
    return pack_rows(values.t(), order).t().contiguous()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# -- writing checkpoints --------------------------------------------------------------------------


def float_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def linear_weights(tensors):
    """(module name, projection, float weight) for every linear layer of the decoder."""
    for name, tensor in tensors.items():
        parts = name.split(".")
        if name.endswith(".weight") and len(parts) > 2 and parts[-2] in LINEARS:
            yield name[: -len(".weight")], parts[-2], tensor


def write_checkpoint(src: Path, dst: Path, tensors: dict, quantization_config: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


@torch.no_grad()
def calibrate_input_amax(src: Path) -> dict[str, float]:
    """Largest |input| of each linear module over a few prompts, as AutoFP8/llm-compressor calibrate."""
    model = tiny_models.load_hf(src)
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEARS:
            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    for prompt in PROMPTS:
        model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return amax


def build_autofp8(src, dst):
    """AutoFP8 (static): per-tensor FP8 weights, ``weight_scale`` and ``input_scale`` scalars."""
    tensors, refs = float_tensors(src), {}
    amax = calibrate_input_amax(src)
    for module, _, w in list(linear_weights(tensors)):
        q, scale, refs[module] = fp8_per_tensor(w)
        tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"] = q, scale.reshape(())
        tensors[f"{module}.input_scale"] = torch.tensor(amax[module] / 448.0)
    config = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    return write_checkpoint(src, dst, tensors, config), refs


def build_hf_finegrained(src, dst, block):
    """transformers' FineGrainedFP8: its own quantizer op writes ``weight`` + ``weight_scale_inv``."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    hf_config = FineGrainedFP8Config(weight_block_size=block)
    op = Fp8Quantize(SimpleNamespace(quantization_config=hf_config))
    tensors, refs = float_tensors(src), {}
    for module, _, w in list(linear_weights(tensors)):
        out = op.convert({f"{module}.weight": w})
        q, inv = out[f"{module}.weight"], out[f"{module}.weight_scale_inv"]
        assert q.dtype == FP8, "the HF op left this weight unquantized; pick dimensions its blocks divide"
        bn, bk = block or q.shape
        refs[module] = q.float() * inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        tensors.update(out)
    return write_checkpoint(src, dst, tensors, hf_config.to_dict()), refs


def compressed_tensors_config(kind: str, static: bool) -> dict:
    """``quantization_config`` as llm-compressor saves the FP8_DYNAMIC / W8A8 presets (static: per tensor)."""
    args = dict(num_bits=8, type=kind, symmetric=True, group_size=None, block_structure=None, actorder=None,
                observer="minmax", observer_kwargs={}, scale_dtype=None, zp_dtype=None)
    weights = dict(args, strategy="channel", dynamic=False)
    acts = dict(args, strategy="tensor", dynamic=False) if static else dict(args, strategy="token", dynamic=True,
                                                                         observer=None)
    return {"quant_method": "compressed-tensors", "format": f"{kind}-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None, "kv_cache_scheme": None,
            "ignore": ["lm_head"], "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": None}},
            "version": "0.12.2"}


def build_compressed_tensors(src, dst, kind, static=False):
    tensors, refs = float_tensors(src), {}
    amax = calibrate_input_amax(src) if static else {}
    quantise = fp8_per_channel if kind == "float" else int8_per_channel
    for module, _, w in list(linear_weights(tensors)):
        q, scale, refs[module] = quantise(w)
        tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"] = q, scale.to(torch.bfloat16).float()
        refs[module] = q.float() * tensors[f"{module}.weight_scale"]
        if static:
            limit = 448.0 if kind == "float" else 127.0
            tensors[f"{module}.input_scale"] = torch.tensor([amax[module] / limit])
    return write_checkpoint(src, dst, tensors, compressed_tensors_config(kind, static)), refs


def build_gptq(src, dst, group_size, desc_act, sym, fmt="gptq", seed=0):
    """AutoGPTQ/GPTQModel 4-bit: qweight [K/8, N], qzeros [G, N/8] (v1: z - 1), scales [G, N], g_idx [K]."""
    from transformers import GPTQConfig

    gen = torch.Generator().manual_seed(seed)
    tensors, refs, perms = float_tensors(src), {}, {}
    for module, proj, w in list(linear_weights(tensors)):
        k = w.shape[1]
        gs = k if group_size == -1 else group_size
        groups = -(-k // gs)
        key = (module.rsplit(".", 2)[0], SAME_INPUT[proj])
        if desc_act:
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[perm] = torch.arange(k) // gs
        else:
            g_idx = torch.arange(k) // gs
        q, zeros, scales, refs[module] = int4_rtn(w, g_idx, groups, sym)
        stored_zeros = zeros - 1 if fmt == "gptq" else zeros
        del tensors[f"{module}.weight"]
        tensors[f"{module}.qweight"] = pack_rows(q.t())
        tensors[f"{module}.qzeros"] = pack_cols(stored_zeros.t())
        tensors[f"{module}.scales"] = scales.t().contiguous().half()
        tensors[f"{module}.g_idx"] = g_idx.to(torch.int32)
    config = GPTQConfig(bits=4, group_size=group_size, desc_act=desc_act, sym=sym, format=fmt).to_dict()
    return write_checkpoint(src, dst, tensors, config), refs


def build_awq(src, dst, group_size):
    """AutoAWQ GEMM: qweight [K, N/8] and qzeros [G, N/8] in the order 0 2 4 6 1 3 5 7, scales [G, N]."""
    from transformers import AwqConfig

    tensors, refs = float_tensors(src), {}
    for module, _, w in list(linear_weights(tensors)):
        k = w.shape[1]
        g_idx = torch.arange(k) // group_size
        q, zeros, scales, refs[module] = int4_rtn(w, g_idx, k // group_size, sym=False)
        del tensors[f"{module}.weight"]
        tensors[f"{module}.qweight"] = pack_cols(q.t(), AWQ_ORDER)
        tensors[f"{module}.qzeros"] = pack_cols(zeros.t(), AWQ_ORDER)
        tensors[f"{module}.scales"] = scales.t().contiguous().half()
    config = AwqConfig(bits=4, group_size=group_size, zero_point=True, version="gemm").to_dict()
    return write_checkpoint(src, dst, tensors, config), refs


# -- fixtures and checks ---------------------------------------------------------------------------

PROMPTS = [list(range(5, 17)), [40, 41, 42, 7, 9, 200, 13], list(range(100, 130, 3)), [3, 1, 4, 1, 5, 9, 2, 6]]
NEW_TOKENS = 16
ENGINE = dict(device="cpu", attention_backend="REFERENCE", kv_cache_memory_bytes=2**26)
#: Layer output vs x @ W_ref.T, relative to max |output|: float32 reference kernels (weight-only
#: formats), or quantized activations on top (the float reference sees the same rounding of W but
#: not of x: FP8's 3 mantissa bits give ~3% relative error per activation, INT8 ~0.4%).
LAYER_BOUND = {"wna16": 1e-5, "fp8": 0.08, "int8": 0.02}
#: Against HF transformers running the test's dequantised weights in float32 (same weights, so only
#: activation quantization differs): teacher-forced on HF's greedy tokens, the share of them the
#: quantized model also ranks first, and the mean |log-prob difference| of those tokens. Weight-only
#: formats (GPTQ, AWQ) must give HF's greedy tokens themselves (``assert_greedy_matches``) with
#: log-probabilities within MAX_DLOGPROB["wna16"].
#: Measured on this tiny, nearly flat random model: FP8 72-86% and 0.08-0.11 nats, INT8 91-95% and
#: 0.03-0.05 nats; GPTQ/AWQ greedy-equal with |dlogprob| <= 4e-6.
MIN_TOP1 = {"fp8": 0.65, "int8": 0.85}
MAX_DLOGPROB = {"fp8": 0.15, "int8": 0.06, "wna16": 1e-3}
#: Against the original float model: quantization noise, not garbage. On this tiny random model
#: RTN 4-bit keeps 38-62% of the float model's greedy tokens first (FP8 77-83%, INT8 89-92%),
#: where a mis-read layout keeps about 1/300 of them.
MIN_TOP1_VS_FLOAT = {"fp8": 0.6, "int8": 0.8, "wna16": 0.25}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    config = tiny_models.tiny_llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                           num_key_value_heads=2)
    return tiny_models.save_model(tmp_path_factory.mktemp("quant-float"), config)


@pytest.fixture(scope="module")
def float_reference(float_dir):
    """The float model's greedy continuations and its log-probabilities along them."""
    llm = LLM(str(float_dir), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)]
    return sequences, teacher_forced(llm, sequences)


def teacher_forced(llm, sequences):
    """Per sequence, (log-probability, rank) of each generated token given the tokens before it."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    result = []
    for seq, out in zip(sequences, outs):
        entries = out.prompt_logprobs[len(seq) - NEW_TOKENS:]
        result.append([(e[t].logprob, e[t].rank) for e, t in zip(entries, seq[len(seq) - NEW_TOKENS:])])
    return result


def model_agreement(llm, float_reference):
    sequences, reference = float_reference
    ours = teacher_forced(llm, sequences)
    pairs = [(r, o) for rs, os in zip(reference, ours) for r, o in zip(rs, os)]
    top1 = sum(o[1] == 1 for r, o in pairs if r[1] == 1) / sum(r[1] == 1 for r, _ in pairs)
    dlogprob = sum(abs(o[0] - r[0]) for r, o in pairs) / len(pairs)
    return top1, dlogprob


def dequantised_hf(src: Path, dst: Path, refs: dict):
    """HF transformers' model on ``src`` with each linear weight replaced by its dequantised reference."""
    tensors = float_tensors(src)
    for module, weight in refs.items():
        tensors[f"{module}.weight"] = weight.float()
    write_checkpoint(src, dst, tensors, {})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return tiny_models.load_hf(dst)


def check_model(llm, float_dir, refs, tmp_path, kind, float_reference):
    hf = dequantised_hf(float_dir, tmp_path / "dequantised", refs)
    hf_runs = [tiny_models.hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    if kind == "wna16":
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        worst = 0.0
        for out, (tokens, logprobs) in zip(outs, hf_runs):
            completion = out.outputs[0]
            tiny_models.assert_greedy_matches(completion.token_ids, tokens, logprobs)
            for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
                if token != tokens[step]:
                    break
                worst = max(worst, abs(entry[token].logprob - float(logprobs[step][token])))
        print(f"{kind}: greedy tokens equal HF's on the dequantised weights, max |dlogprob| {worst:.2e}")
        assert worst <= MAX_DLOGPROB[kind]
    else:
        sequences = [p + tokens for p, (tokens, _) in zip(PROMPTS, hf_runs)]
        ours = teacher_forced(llm, sequences)
        pairs = [(float(lps[i][t]), o) for (tokens, lps), os in zip(hf_runs, ours)
                 for i, (t, o) in enumerate(zip(tokens, os))]
        top1 = sum(o[1] == 1 for _, o in pairs) / len(pairs)
        dlogprob = sum(abs(o[0] - r) for r, o in pairs) / len(pairs)
        print(f"{kind}: vs HF on dequantised weights: top-1 {top1:.3f}, mean |dlogprob| {dlogprob:.4f}")
        assert top1 >= MIN_TOP1[kind], f"{kind}: ranks HF's greedy token first only {top1:.0%}"
        assert dlogprob <= MAX_DLOGPROB[kind], f"{kind}: mean |log-prob difference| {dlogprob:.3f}"
    top1, dlogprob = model_agreement(llm, float_reference)
    print(f"{kind}: vs the float model: top-1 {top1:.3f}, mean |dlogprob| {dlogprob:.4f}")
    assert top1 >= MIN_TOP1_VS_FLOAT[kind], f"{kind}: ranks the float model's token first only {top1:.0%}"


MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def check_layers(llm, refs, kind, method_name):
    """Each loaded linear layer against x @ W_ref.T for its (merged) reference weights."""
    model = llm.llm_engine.model
    merged: dict[str, dict[int, torch.Tensor]] = {}
    for module, ref in refs.items():
        parent, proj = module.rsplit(".", 1)
        target, shard = MERGED.get(proj, (proj, 0))
        merged.setdefault(f"{parent}.{target}", {})[shard] = ref
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for name, shards in merged.items():
        layer = model.get_submodule(name)
        assert layer.method.name == method_name, f"{name} was not loaded as {method_name}"
        weight = torch.cat([shards[i] for i in sorted(shards)])
        x = torch.randn(5, weight.shape[1], generator=gen)
        static = getattr(layer, "input_scale", None)
        if static is not None:  # keep x within the calibrated range, as real activations are
            x *= 0.9 * float(static) * (448.0 if layer.weight.dtype == FP8 else 127.0) / x.abs().max()
        with torch.no_grad():
            out = layer(x)
        expected = x @ weight.t()
        err = float((out - expected).abs().max() / expected.abs().max())
        worst = max(worst, err)
        assert err <= LAYER_BOUND[kind], f"{name}: relative error {err:.2e} > {LAYER_BOUND[kind]}"
    print(f"{method_name} ({kind}): worst layer relative error {worst:.2e}")


# -- tests ---------------------------------------------------------------------------------------------


def test_fp8_at_load_from_float_checkpoint(float_dir, float_reference, tmp_path):
    llm = LLM(str(float_dir), quantization="fp8", **ENGINE)
    layer = llm.llm_engine.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (layer.output_size,)
    refs = {m: fp8_per_channel(w)[2] for m, _, w in linear_weights(float_tensors(float_dir))}
    check_layers(llm, refs, "fp8", "fp8")
    check_model(llm, float_dir, refs, tmp_path, "fp8", float_reference)


def test_int8_at_load_from_float_checkpoint(float_dir, float_reference, tmp_path):
    llm = LLM(str(float_dir), quantization="int8", **ENGINE)
    refs = {}
    for m, _, w in linear_weights(float_tensors(float_dir)):
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
        refs[m] = torch.round(w / scale).clamp(-127, 127) * scale
    check_layers(llm, refs, "int8", "int8")
    check_model(llm, float_dir, refs, tmp_path, "int8", float_reference)


def test_autofp8_static_per_tensor_checkpoint(float_dir, float_reference, tmp_path):
    path, refs = build_autofp8(float_dir, tmp_path / "autofp8")
    llm = LLM(str(path), **ENGINE)
    layer = llm.llm_engine.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    scales = float_tensors(path)
    expected = max(float(scales[f"model.layers.0.self_attn.{p}.input_scale"]) for p in ("q_proj", "k_proj", "v_proj"))
    assert float(layer.input_scale) == expected, "merged static input scales keep the largest"
    check_layers(llm, refs, "fp8", "fp8")
    check_model(llm, float_dir, refs, tmp_path, "fp8", float_reference)


@pytest.mark.parametrize("block", [[32, 32], None], ids=["block32x32", "per-tensor"])
def test_hf_finegrained_fp8_checkpoint(float_dir, float_reference, tmp_path, block):
    path, refs = build_hf_finegrained(float_dir, tmp_path / "finegrained", block)
    llm = LLM(str(path), **ENGINE)
    check_layers(llm, refs, "fp8", "fp8")
    check_model(llm, float_dir, refs, tmp_path, "fp8", float_reference)


@pytest.mark.parametrize("kind,static", [("float", False), ("int", True)], ids=["fp8-dynamic", "int8-static"])
def test_compressed_tensors_w8a8_checkpoint(float_dir, float_reference, tmp_path, kind, static):
    path, refs = build_compressed_tensors(float_dir, tmp_path / "ct", kind, static)
    llm = LLM(str(path), **ENGINE)
    family = "fp8" if kind == "float" else "int8"
    check_layers(llm, refs, family, "compressed-tensors")
    check_model(llm, float_dir, refs, tmp_path, family, float_reference)


@pytest.mark.parametrize("group_size,desc_act,sym,fmt", [
    (32, True, False, "gptq"), (128, False, True, "gptq_v2"), (-1, False, False, "gptq"),
], ids=["g32-actorder-asym-v1", "g128-sym-v2", "g-1-asym-v1"])
def test_gptq_checkpoint(float_dir, float_reference, tmp_path, group_size, desc_act, sym, fmt):
    path, refs = build_gptq(float_dir, tmp_path / "gptq", group_size, desc_act, sym, fmt)
    llm = LLM(str(path), **ENGINE)
    check_layers(llm, refs, "wna16", "gptq")
    check_model(llm, float_dir, refs, tmp_path, "wna16", float_reference)


def test_gptq_checkpoint_without_g_idx_loads_and_dummy_weights_work(float_dir, float_reference, tmp_path):
    """Some GPTQ writers omit g_idx without act-order; it is then k // group_size (also under dummy weights)."""
    path, refs = build_gptq(float_dir, tmp_path / "gptq", 64, False, False)
    tensors = {k: v for k, v in float_tensors(path).items() if not k.endswith(".g_idx")}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    check_layers(LLM(str(path), **ENGINE), refs, "wna16", "gptq")
    llm = LLM(str(path), load_format="dummy", **ENGINE)
    layer = llm.llm_engine.model.get_submodule("model.layers.0.mlp.down_proj")
    assert torch.equal(layer.g_idx.long(), torch.arange(layer.input_size) // 64)


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_gemm_checkpoint(float_dir, float_reference, tmp_path, group_size):
    path, refs = build_awq(float_dir, tmp_path / "awq", group_size)
    llm = LLM(str(path), **ENGINE)
    check_layers(llm, refs, "wna16", "awq")
    check_model(llm, float_dir, refs, tmp_path, "wna16", float_reference)


# -- refusals --------------------------------------------------------------------------------------------


def test_flag_conflicting_with_checkpoint_is_refused(float_dir, tmp_path):
    path, _ = build_awq(float_dir, tmp_path / "awq", 32)
    with pytest.raises(SelectionError, match=r"--quantization 'fp8' conflicts with the checkpoint.*'awq'"):
        LLM(str(path), quantization="fp8", **ENGINE)


@pytest.mark.parametrize("name", ["gptq", "awq", "compressed-tensors"])
def test_checkpoint_formats_refuse_a_float_checkpoint(float_dir, name):
    with pytest.raises(SelectionError, match=rf"'{name}' reads .* checkpoints .*cannot quantize weights at load"):
        LLM(str(float_dir), quantization=name, **ENGINE)


def test_unsupported_checkpoint_variants_are_refused_naming_the_field(float_dir, tmp_path):
    path, _ = build_awq(float_dir, tmp_path / "awq", 32)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantization_config.version: AWQ layout 'gemv'"):
        LLM(str(path), **ENGINE)
    path, _ = build_gptq(float_dir, tmp_path / "gptq3", 32, False, True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantization_config.bits: GPTQ with 3 bits"):
        LLM(str(path), **ENGINE)
    w4a16 = compressed_tensors_config("int", static=False)
    w4a16["config_groups"]["group_0"]["weights"].update(num_bits=4, strategy="group", group_size=32)
    with pytest.raises(ConfigError, match=r"config_groups.group_0.weights: 4-bit int weights are not supported"):
        LLM(str(write_checkpoint(float_dir, tmp_path / "w4a16", float_tensors(float_dir), w4a16)), **ENGINE)
    with pytest.raises(ConfigError, match=r"no checkpoint format is named 'int8'"):
        LLM(str(write_checkpoint(float_dir, tmp_path / "int8", float_tensors(float_dir),
                                 {"quant_method": "int8"})), **ENGINE)


def test_fp8_refused_where_fp8_tensors_cannot_be_made(float_dir, monkeypatch):
    from dovetail.quantization import quant_ops

    monkeypatch.setattr(quant_ops, "fp8_missing_reason", lambda: "torch 0.0 has no float8_e4m3fn dtype")
    with pytest.raises(SelectionError, match=r"quantization 'fp8' cannot run here: .*needs FP8 tensors: "
                                             r"torch 0.0 has no float8_e4m3fn"):
        LLM(str(float_dir), quantization="fp8", **ENGINE)


def test_act_order_permutations_that_disagree_across_merged_shards_are_refused(float_dir, tmp_path):
    path, _ = build_gptq(float_dir, tmp_path / "gptq", 32, True, False)
    tensors = float_tensors(path)
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"qkv_proj.g_idx \(shard \d\) differs from the other shards"):
        LLM(str(path), **ENGINE)


# -- tensor parallelism ---------------------------------------------------------------------------------


def tp_run(path: str) -> tuple[dict, list]:
    """On each rank of a tensor-parallel group (tests/spmd.py): the shapes of two layers' parameters, and
    greedy completions with their top log-probabilities."""
    llm = LLM(path, cpu_threads=1, **ENGINE)
    return layer_shapes(llm), tiny_models.completions(llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], TP_PARAMS, use_tqdm=False))


TP_PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
TP_LAYERS = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj")


def layer_shapes(llm) -> dict[str, tuple[int, ...]]:
    return {f"{layer}.{name}": tuple(p.shape) for layer in TP_LAYERS
            for name, p in llm.llm_engine.model.get_submodule(layer).named_parameters()}


#: Checkpoints whose sharding changes nothing but the order of float32 sums: weight-only formats, FP8
#: blocks (activations quantized per group of 32 features, which the ranks' slices hold whole) and
#: static activation scales. Per-token dynamic activations would differ: a rank sees half a token.
TP_CHECKPOINTS = {
    "gptq-g32-actorder": lambda src, dst: build_gptq(src, dst, 32, True, False),  # every rank keeps every group
    "gptq-g128-sym-v2": lambda src, dst: build_gptq(src, dst, 128, False, True, "gptq_v2"),
    "awq-g32": lambda src, dst: build_awq(src, dst, 32),  # o_proj and down_proj ranks keep their own groups
    "autofp8-static": build_autofp8,
    "fp8-block32": lambda src, dst: build_hf_finegrained(src, dst, [32, 32]),
    "int8-static": lambda src, dst: build_compressed_tensors(src, dst, "int", static=True),
}


#: Log-probability tolerance at TP=2 against one rank (and the top-two gap under which their greedy tokens
#: may part). Weight-only formats differ by float32 rounding. With quantized activations, the ranks' sums in
#: another order can move an activation across an FP8/INT8 rounding edge: measured up to 0.03 nats on this
#: tiny model (AVX2), where a mis-split tensor (a wrong block of scales, groups or rows) moves logits by nats.
TP_TOLERANCE = {"weight-only": 1e-3, "w8a8": 0.15}
W8A8 = ("autofp8-static", "fp8-block32", "int8-static")


def rank_shape(layer: str, name: str, shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """A parameter's shape on each of two ranks: QKV (column-parallel) halves its output dimension,
    down_proj (row-parallel) its input dimension; act-order GPTQ keeps every group's scales and zeros."""
    if layer.endswith("qkv_proj"):
        dim = {"weight": 0, "weight_scale": 0, "weight_scale_inv": 0, "qweight": 1, "scales": 1, "zeros": 1}.get(name)
    else:
        dim = {"weight": 1, "weight_scale_inv": 1, "qweight": 0, "g_idx": 0}.get(name)
        if name in ("scales", "zeros") and fmt != "gptq-g32-actorder":
            dim = 0
    return shape if dim is None else shape[:dim] + (shape[dim] // 2,) + shape[dim + 1:]


@pytest.mark.parametrize("fmt", sorted(TP_CHECKPOINTS))
def test_quantized_checkpoints_at_tensor_parallel_2_match_one_rank(float_dir, tmp_path, tp_ranks, fmt):
    """Two ranks (real processes over gloo) hold their slices of the quantized tensors and generate what one
    rank does."""
    path, _ = TP_CHECKPOINTS[fmt](float_dir, tmp_path / fmt)
    llm = LLM(str(path), **ENGINE)
    one_rank = tiny_models.completions(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], TP_PARAMS,
                                                    use_tqdm=False))
    (shapes, results), (shapes_1, results_1) = tp_ranks(2).run(tp_run, str(path))
    assert results == results_1, "the ranks sampled different tokens or log-probabilities"
    tiny_models.check_matches(results, one_rank, tol=TP_TOLERANCE["w8a8" if fmt in W8A8 else "weight-only"])
    expected = {name: rank_shape(name.rsplit(".", 1)[0], name.rsplit(".", 1)[1], shape, fmt)
                for name, shape in layer_shapes(llm).items()}
    assert shapes == shapes_1 == expected
