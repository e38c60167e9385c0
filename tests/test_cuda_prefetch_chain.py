"""The CUDA plugin's L2 prefetch chain (``dovetail_cuda.prefetch_chain``): which bytes each one-token FP8 GEMV asks
L2 for. Host-side logic on CPU tensors (the addresses are all it reads); the kernel's side is in
test_cuda_fp8_gemv.py."""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("dovetail_cuda")

from dovetail.errors import ConfigError  # noqa: E402
from dovetail_cuda.fp8_gemv import Prefetch, prefetch_of  # noqa: E402
from dovetail_cuda.prefetch_chain import DEFAULT_MB, PrefetchChain, prefetch_settings  # noqa: E402

MIB = 1 << 20


def _weight(rows, k, pitch=None):
    storage = torch.empty(rows, pitch or k, dtype=torch.uint8)
    return storage[:, :k].view(torch.float8_e4m3fn)


def test_prefetch_of_covers_leading_rows_and_both_halves_when_gated():
    w = _weight(64, 100, pitch=128)
    whole = (64 - 1) * 128 + 100  # the last row ends at its k-th byte, not at the pitch
    assert prefetch_of(w, False, 1 << 30) == Prefetch(w.data_ptr(), 0, whole, False)
    assert prefetch_of(w, False, 1000, True) == Prefetch(w.data_ptr(), 0, 1000, True)
    half = prefetch_of(w, True, 1000)
    assert half == Prefetch(w.data_ptr(), w.data_ptr() + 32 * 128, 500, False)
    assert prefetch_of(w, True, 1 << 30).size == 31 * 128 + 100


def test_chain_learns_the_order_of_calls_and_wraps_around():
    qkv, o, gate_up, down = _weight(96, 64), _weight(64, 64), _weight(256, 64), _weight(64, 128)
    chain = PrefetchChain(4 * MIB)
    step = [(qkv, False), (o, False), (gate_up, True), (down, False)]
    assert [chain.next_for(w, g) for w, g in step] == [None] * 4  # nothing learnt yet
    second = [chain.next_for(w, g) for w, g in step]
    assert second[0] == prefetch_of(o, False, 4 * MIB)
    assert second[1] == prefetch_of(gate_up, True, 4 * MIB), "gate/up is read gated: both halves"
    assert second[2] == prefetch_of(down, False, 4 * MIB)
    assert second[3] == prefetch_of(qkv, False, 4 * MIB), "the last linear's successor is the next step's first"
    assert all(p.second == 0 for i, p in enumerate(second) if i != 1) and second[1].second != 0


def test_a_changed_order_replaces_the_successor_and_repeats_are_not_successors():
    a, b, c = _weight(32, 64), _weight(32, 64), _weight(32, 64)
    chain = PrefetchChain(MIB, evict_last=True)
    for w in (a, b, a):
        chain.next_for(w, False)
    assert chain.next_for(a, False) == prefetch_of(b, False, MIB, True), "a called twice in a row is not a->a"
    chain.next_for(c, False)
    assert chain.next_for(a, False) == prefetch_of(c, False, MIB, True)


def test_freed_weights_are_never_prefetched():
    a = _weight(32, 64)
    b = _weight(32, 64)
    chain = PrefetchChain(MIB)
    for w in (a, b, a):
        chain.next_for(w, False)
    del b
    gc.collect()
    assert chain.next_for(a, False) is None


def test_limit_zero_turns_it_off():
    a, b = _weight(32, 64), _weight(32, 64)
    chain = PrefetchChain(0)
    assert [chain.next_for(w, False) for w in (a, b, a, b)] == [None] * 4


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.delenv("DOVETAIL_CUDA_FP8_PREFETCH_MB", raising=False)
    monkeypatch.delenv("DOVETAIL_CUDA_FP8_PREFETCH_POLICY", raising=False)
    assert prefetch_settings() == (DEFAULT_MB * MIB, False)
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_PREFETCH_MB", "0.5")
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_PREFETCH_POLICY", "Evict_Last")
    assert prefetch_settings() == (MIB // 2, True)
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("DOVETAIL_CUDA_FP8_PREFETCH_MB", bad)
        with pytest.raises(ConfigError, match="DOVETAIL_CUDA_FP8_PREFETCH_MB"):
            prefetch_settings()
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_PREFETCH_MB", "8")
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_PREFETCH_POLICY", "sticky")
    with pytest.raises(ConfigError, match="DOVETAIL_CUDA_FP8_PREFETCH_POLICY='sticky'"):
        prefetch_settings()
