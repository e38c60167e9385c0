"""The Platform contract and the fused ops a platform returns."""

from __future__ import annotations

import torch

from dovetail.ops import FusedOps
from dovetail.platform import Platform, ProbeResult
from dovetail.quantization.kernels import QuantKernels


def check_platform(platform_cls: type[Platform]) -> Platform | None:
    """Check the class contract, the probe, and (when usable here) the instance's answers.

    Returns the instance, or None when the probe says the platform is not usable here
    (the probe's reason must then be non-empty).
    """
    for attr in ("name", "device_type", "dist_backend"):
        value = getattr(platform_cls, attr, None)
        assert isinstance(value, str) and value, f"{platform_cls.__name__}.{attr} must be a non-empty string"
    env = getattr(platform_cls, "visible_devices_env", None)
    assert env is None or (isinstance(env, str) and env.isidentifier()), \
        f"{platform_cls.__name__}.visible_devices_env must be None or an environment variable's name"
    result = platform_cls.probe()
    assert isinstance(result, ProbeResult), f"{platform_cls.__name__}.probe() must return a ProbeResult"
    if not result.usable:
        assert result.reason, f"{platform_cls.__name__}.probe() said unusable without a reason"
        return None
    platform = platform_cls()
    assert platform.device_count() >= 1, "a usable platform must see at least one device"
    total, free = platform.memory_total(), platform.memory_free()
    assert 0 <= free <= total and total > 0, f"memory_free ({free}) must lie in [0, memory_total ({total})]"
    dtypes = platform.supported_dtypes()
    assert dtypes and all(isinstance(d, torch.dtype) for d in dtypes), "supported_dtypes must list torch dtypes"
    backends = platform.default_attention_backends()
    assert backends and all(isinstance(b, str) for b in backends), "default_attention_backends must name backends"
    assert isinstance(platform.device(0), torch.device)
    assert platform.device(0).type == platform.device_type
    assert isinstance(platform.memory_stats(), dict)
    platform.synchronize()
    platform.empty_cache()
    ops = platform.fused_ops()
    assert isinstance(ops, FusedOps), "fused_ops() must return a dovetail.ops.FusedOps"
    assert isinstance(platform.quant_kernels(), QuantKernels), "quant_kernels() must return a QuantKernels"
    check_fused_ops(ops, platform.device(0), dtypes[0])
    return platform


def check_fused_ops(ops: FusedOps, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    seed: int = 0) -> None:
    """Each fused op equals the plain-torch definition in :mod:`dovetail.ops` on random inputs."""
    ref = FusedOps()
    gen = torch.Generator().manual_seed(seed)
    tol = 1e-4 if dtype == torch.float32 else 2e-2

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def close(a, b, what):
        diff = (a.float() - b.float()).abs().max().item()
        scale = max(1.0, b.float().abs().max().item())
        assert diff <= tol * scale, f"{type(ops).__name__}.{what} differs from the torch definition by {diff:.3g}"

    for tokens, hidden in ((1, 64), (7, 512), (33, 1000)):
        x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
        close(ops.rms_norm(x.clone(), weight, 1e-6), ref.rms_norm(x, weight, 1e-6), "rms_norm")
        got_out, got_res = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
        want_out, want_res = ref.add_rms_norm(x, residual, weight, 1e-6)
        close(got_out, want_out, "add_rms_norm (output)")
        close(got_res, want_res, "add_rms_norm (residual)")
        gate_up = rand(tokens, 2 * hidden)
        close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), "silu_and_mul")
    for rows, out_features, in_features in ((1, 96, 64), (3, 300, 512), (40, 130, 256)):
        x, weight, bias = rand(rows, in_features), rand(out_features, in_features), rand(out_features)
        close(ops.linear(x, weight, bias), ref.linear(x, weight, bias), "linear (with bias)")
        close(ops.linear(x, weight), ref.linear(x, weight), "linear")
        gate_up, gate_up_bias = weight[:out_features // 2 * 2], bias[:out_features // 2 * 2]  # [gate | up] rows
        for activation, act in (("silu", ref.silu_and_mul), ("gelu_tanh", ref.gelu_tanh_and_mul)):
            gated = ops.linear_gated(x, gate_up, gate_up_bias, activation)
            if gated is not None:
                close(gated, act(ref.linear(x, gate_up, gate_up_bias)), f"linear_gated ({activation})")
    for head_size, rotary_dim, heads, kv_heads in ((64, 64, 4, 2), (128, 128, 8, 8), (128, 64, 2, 1)):
        tokens, max_pos = 9, 64
        positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
        freqs = torch.rand(max_pos, rotary_dim // 2, generator=gen) * 6.28
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        q, k = rand(tokens, heads * head_size), rand(tokens, kv_heads * head_size)
        got_q, got_k = ops.rotary_embedding(positions, q.clone(), k.clone(), cache, head_size, rotary_dim)
        want_q, want_k = ref.rotary_embedding(positions, q, k, cache, head_size, rotary_dim)
        close(got_q, want_q, "rotary_embedding (q)")
        close(got_k, want_k, "rotary_embedding (k)")
        q_w, k_w = rand(head_size) + 1.0, rand(head_size) + 1.0
        got_q, got_k = ops.qk_norm_rotary_embedding(positions, q.clone(), k.clone(), q_w, k_w, 1e-6, cache,
                                                    head_size, rotary_dim)
        want_q, want_k = ref.qk_norm_rotary_embedding(positions, q, k, q_w, k_w, 1e-6, cache, head_size, rotary_dim)
        close(got_q, want_q, "qk_norm_rotary_embedding (q)")
        close(got_k, want_k, "qk_norm_rotary_embedding (k)")
    for rows, vocab in ((1, 50), (3, 9000)):
        logits = rand(rows, vocab)
        logits[:, vocab // 3] = logits[:, 2 * vocab // 3] = logits.float().max() + 4  # a tie: the first index wins
        assert torch.equal(ops.argmax(logits).cpu(), ref.argmax(logits).cpu()), \
            f"{type(ops).__name__}.argmax differs from the first maximal index of each row"
    for tokens, experts, top_k in ((1, 8, 2), (9, 6, 3)):
        x, logits = rand(tokens, 64), rand(tokens, experts).float()
        w13, w2 = rand(experts, 64, 64) * 0.125, rand(experts, 64, 32) * 0.18
        weights, ids = ops.select_experts(logits, top_k, True)
        want_weights, want_ids = ref.select_experts(logits, top_k, True)
        assert torch.equal(ids.long().cpu(), want_ids.cpu()), \
            f"{type(ops).__name__}.select_experts chose other experts than the softmax top-k"
        close(weights, want_weights, "select_experts (weights)")
        close(ops.fused_moe(x, w13, w2, weights, ids), ref.fused_moe(x, w13, w2, want_weights, want_ids),
              "fused_moe")
        close(ops.routed_moe(x, logits, w13, w2, top_k, True), ref.fused_moe(x, w13, w2, want_weights, want_ids),
              "routed_moe")
