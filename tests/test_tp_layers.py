"""Column-, row- and vocabulary-parallel layers against the dense layers, on two ranks over gloo.

Each rank builds the parallel layer, loads it from the whole checkpoint tensors
(as tensors, and lazily from a safetensors file), and runs the same input; the
ranks' weights must be their slices and their outputs the dense output's slices
(column-parallel) or the whole dense output (row-parallel, vocabulary-parallel).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dovetail.model_interface import ModelContext
from dovetail.ops import FusedOps
from dovetail.quantization.unquantized import UnquantizedMethod

HIDDEN, VOCAB, TOKENS = 16, 13, 5


def dense_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (24, HIDDEN), "b": (8, HIDDEN), "bias_a": (24,), "bias_b": (8,), "q": (16, HIDDEN),
              "k": (4, HIDDEN), "v": (4, HIDDEN), "row": (8, HIDDEN), "row_bias": (8,), "vocab": (VOCAB, 8),
              "head": (VOCAB, HIDDEN), "x": (TOKENS, HIDDEN)}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _ctx():
    return ModelContext(dtype=torch.float32, device=torch.device("cpu"), quant=UnquantizedMethod(),
                        attention_backend=None, ops=FusedOps())


def layers_job(path: str, lazy: bool) -> dict:
    """On each rank: the parallel layers loaded from ``path``; their weights and outputs."""
    from safetensors import safe_open

    from dovetail.checkpoint_tensor import CheckpointTensor
    from dovetail.distributed import tp_rank, tp_size
    from dovetail.layers.embedding import LMHead, VocabEmbedding
    from dovetail.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    out = {}
    with safe_open(path, framework="pt") as f:
        def t(name):
            return CheckpointTensor(f.get_slice(name), name) if lazy else f.get_tensor(name)

        x = f.get_tensor("x")
        ctx = _ctx()
        merged = ColumnParallelLinear(HIDDEN, [24, 8], True, ctx, "merged")
        for shard, name in enumerate("ab"):
            merged.load_shard(merged.weight, t(name), shard, name)
            merged.load_shard(merged.bias, t(f"bias_{name}"), shard, f"bias_{name}")
        fused = ColumnParallelLinear(HIDDEN, [24, 8], False, ctx, "fused")
        whole = torch.cat([f.get_tensor("a"), f.get_tensor("b")])
        fused.load_shard(fused.weight, whole, None, "ab")
        qkv = QKVParallelLinear(HIDDEN, 4, 4, 1, False, ctx, "qkv")
        for shard, name in enumerate("qkv"):
            qkv.load_shard(qkv.weight, t(name), shard, name)
        row = RowParallelLinear(HIDDEN, 8, True, ctx, "row")
        row.load_shard(row.weight, t("row"), None, "row")
        row.load_shard(row.bias, t("row_bias"), None, "row_bias")
        embedding = VocabEmbedding(VOCAB, 8, ctx, scale=2.0)
        embedding.weight.weight_loader(embedding.weight, t("vocab"), None)
        head = LMHead(VOCAB, HIDDEN, ctx, final_logit_softcap=3.0)
        head.weight.weight_loader(head.weight, t("head"), None)
        with torch.no_grad():
            out["merged"] = (merged.weight.clone(), merged(x))
            out["fused"] = (fused.weight.clone(), fused(x))
            out["qkv"] = (qkv.weight.clone(), qkv(x), qkv.num_heads, qkv.num_kv_heads)
            out["row"] = (row.weight.clone(), row(x.chunk(tp_size(), dim=1)[tp_rank()]))
            ids = torch.tensor([0, 12, 6, 7, 3, 11, 12])
            out["embedding"] = (embedding.weight.clone(), embedding(ids))
            out["head"] = (head.weight.clone(), head(x))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tensors = dense_tensors()
    path = tmp_path_factory.mktemp("tp-layers") / "layers.safetensors"
    save_file(tensors, str(path))
    return str(path), tensors


@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "lazy-slices"])
def test_parallel_layers_are_slices_of_the_dense_layers(tp_ranks, checkpoint, lazy):
    path, d = checkpoint
    x = d["x"]
    ranks = tp_ranks(2).run(layers_job, path, lazy)
    for rank, got in enumerate(ranks):
        # Column-parallel, merged: each part split on its own ([a_r | b_r]), the bias too.
        a, b = d["a"].chunk(2)[rank], d["b"].chunk(2)[rank]
        weight, y = got["merged"]
        assert torch.equal(weight, torch.cat([a, b]))
        bias = torch.cat([d["bias_a"].chunk(2)[rank], d["bias_b"].chunk(2)[rank]])
        torch.testing.assert_close(y, F.linear(x, torch.cat([a, b]), bias))
        weight, y = got["fused"]  # a fused checkpoint tensor (Phi-3) splits the same way
        assert torch.equal(weight, torch.cat([a, b]))
        # QKV with 4 heads and 1 KV head: 2 query heads each, the KV head replicated.
        weight, y, heads, kv_heads = got["qkv"]
        assert (heads, kv_heads) == (2, 1)
        assert torch.equal(weight, torch.cat([d["q"].chunk(2)[rank], d["k"], d["v"]]))
        # Row-parallel: the weight's and the input's columns split; the all-reduced output whole on every rank.
        weight, y = got["row"]
        assert torch.equal(weight, d["row"].chunk(2, dim=1)[rank])
        torch.testing.assert_close(y, F.linear(x, d["row"], d["row_bias"]))
        # Vocabulary-parallel: 13 rows as 7 + 6 and a padding row; lookups and logits whole on every rank.
        weight, emb = got["embedding"]
        rows = d["vocab"][7 * rank:7 * rank + 7]
        assert weight.shape == (7, 8) and torch.equal(weight[:len(rows)], rows) and not weight[len(rows):].any()
        ids = torch.tensor([0, 12, 6, 7, 3, 11, 12])
        torch.testing.assert_close(emb, F.embedding(ids, d["vocab"]) * 2.0)
        weight, logits = got["head"]
        assert weight.shape == (7, HIDDEN)
        torch.testing.assert_close(logits, torch.tanh(x @ d["head"].t() / 3.0) * 3.0)


def test_sizes_the_ranks_cannot_share_are_one_line_errors(monkeypatch):
    from dovetail.distributed import parallel_state
    from dovetail.errors import ConfigError
    from dovetail.layers.linear import ColumnParallelLinear, QKVParallelLinear
    from dovetail.layers.moe import FusedMoE

    monkeypatch.setattr(parallel_state, "_size", 4)  # construction reads the size; no collective runs
    with pytest.raises(ConfigError, match=r"^num_attention_heads 6 is not divisible by tensor_parallel_size 4$"):
        QKVParallelLinear(HIDDEN, 4, 6, 2, False, _ctx(), "qkv")
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size 4 is not divisible by num_key_value_heads 3 "):
        QKVParallelLinear(HIDDEN, 4, 12, 3, False, _ctx(), "qkv")
    with pytest.raises(ConfigError, match=r"^layer up: output size 10 is not divisible by tensor_parallel_size 4$"):
        ColumnParallelLinear(HIDDEN, 10, False, _ctx(), "up")
    with pytest.raises(ConfigError, match=r"^num_experts 6 is not divisible by tensor_parallel_size 4$"):
        FusedMoE(6, 2, HIDDEN, 8, _ctx(), "experts")


def read_tally_job(path: str) -> dict[str, int]:
    """On each rank: the bytes read of each checkpoint tensor while an engine loads ``path``."""
    from dovetail import LLM
    from dovetail.checkpoint_tensor import CheckpointTensor

    reads: dict[str, int] = {}
    original = CheckpointTensor.read

    def spy(self):
        tensor = original(self)
        reads[self.name] = reads.get(self.name, 0) + tensor.numel() * tensor.element_size()
        return tensor

    CheckpointTensor.read = spy
    try:
        LLM(path, device="cpu", attention_backend="REFERENCE", max_model_len=128, kv_cache_memory_bytes=2**22,
            cpu_threads=1)
    finally:
        CheckpointTensor.read = original
    return reads


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from test_models_vs_hf import CASES, save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("tp-moe"), CASES["qwen3moe-normtopk-dense-layer"]())


def expected_reads(name: str, dim: int, nbytes: int, rank: int, num_experts: int = 4) -> int:
    """What rank ``rank`` of two reads of a tensor: half of a matrix, a whole vector or router, an expert's
    tensors only on the rank that holds the expert (the first half of them on rank 0)."""
    expert = re.search(r"\.experts\.(\d+)\.", name)
    if expert:
        return nbytes if int(expert[1]) // (num_experts // 2) == rank else 0
    if dim == 1 or name.endswith(".mlp.gate.weight"):
        return nbytes
    return nbytes // 2


@pytest.mark.parametrize("model", ["llama", "qwen3-moe"])
def test_each_rank_reads_only_its_slices_of_the_checkpoint(tp_ranks, tiny_llama_dir, tiny_moe_dir, model):
    """Matrices (projections, embedding, LM head) are read half per rank, vectors (norms) and the MoE router
    whole, each expert by the rank that holds it: a rank never reads a whole matrix it keeps part of."""
    from safetensors import safe_open

    path = tiny_llama_dir if model == "llama" else tiny_moe_dir
    sizes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                sizes[name] = (tensor.dim(), tensor.numel() * tensor.element_size())
    assert any(dim == 1 for dim, _ in sizes.values()) and any(dim == 2 for dim, _ in sizes.values())
    for rank, reads in enumerate(tp_ranks(2).run(read_tally_job, str(path))):
        expected = {name: expected_reads(name, dim, nbytes, rank) for name, (dim, nbytes) in sizes.items()}
        assert reads == {name: nbytes for name, nbytes in expected.items() if nbytes}


def all_reduce_kernel_job() -> dict:
    """On each rank: all-reduces with a platform kernel that takes only small tensors (summing them its own
    way, through an all-gather) and what each path returned."""
    from dovetail import distributed

    taken = []

    def kernel(tensor):
        if tensor.numel() > 4:
            return False
        taken.append(tensor.numel())
        tensor.copy_(distributed.all_gather(tensor.unsqueeze(0), dim=0).sum(0))
        return True

    rank = distributed.tp_rank()
    small, large = torch.arange(4.0) + 10 * rank, torch.arange(6.0) + 10 * rank
    distributed.set_all_reduce_kernel(kernel)
    try:
        results = (distributed.all_reduce(small.clone()), distributed.all_reduce(large.clone()))
    finally:
        distributed.set_all_reduce_kernel(None)
    return {"small": results[0], "large": results[1], "taken": taken}


def test_a_platform_all_reduce_kernel_takes_the_messages_it_accepts(tp_ranks):
    for got in tp_ranks(2).run(all_reduce_kernel_job):
        assert got["taken"] == [4], "the kernel sums what it takes; the backend the rest"
        torch.testing.assert_close(got["small"], 2 * torch.arange(4.0) + 10)
        torch.testing.assert_close(got["large"], 2 * torch.arange(6.0) + 10)


class FusingKernel:
    """A platform all-reduce kernel with the fused ``add_rms_norm``: gloo's sum, then the reference add and norm;
    it counts the calls, and takes plain all-reduces nowhere (the backend's run)."""

    def __init__(self):
        self.fused = 0

    def __call__(self, tensor) -> bool:
        return False

    def add_rms_norm(self, x, residual, weight, eps):
        import torch.distributed as dist

        self.fused += 1
        dist.all_reduce(x)
        return FusedOps().add_rms_norm(x, residual, weight, eps)


def fused_norm_job(path: str, fuse: bool) -> dict:
    """On each rank: greedy tokens of an engine whose platform offers :class:`FusingKernel` (or no kernel),
    and how many norms went through the kernel."""
    from dovetail import LLM, SamplingParams
    from dovetail_cpu.platform import CpuPlatform

    kernel = FusingKernel() if fuse else None
    original = CpuPlatform.all_reduce_kernel
    CpuPlatform.all_reduce_kernel = lambda self, group, device: kernel
    try:
        llm = LLM(path, device="cpu", attention_backend="REFERENCE", max_model_len=128, kv_cache_memory_bytes=2**22,
                  cpu_threads=1)
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)
    finally:
        CpuPlatform.all_reduce_kernel = original
    return {"tokens": [o.outputs[0].token_ids for o in outputs], "fused": kernel.fused if kernel else 0}


@pytest.mark.parametrize("model", ["llama", "qwen3-moe"])
def test_row_parallel_sums_reach_the_norms_and_the_platform_fuses_them(tp_ranks, tiny_llama_dir, tiny_moe_dir, model):
    """Under tensor parallelism the attention's, MLP's and MoE block's partial sums are all-reduced by the norms
    after them; a platform kernel with ``add_rms_norm`` takes every one of them (a layer's two norms after the
    first, the final norm) and the tokens are those of the backend's all-reduce."""
    import json

    path = tiny_llama_dir if model == "llama" else tiny_moe_dir
    group = tp_ranks(2)
    plain = group.run(fused_norm_job, str(path), False)
    fused = group.run(fused_norm_job, str(path), True)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    for rank in range(2):
        assert fused[rank]["tokens"] == plain[rank]["tokens"]
        # Every forward fuses 2 * layers norms (the first layer's input norm gets the embedding, already summed).
        assert fused[rank]["fused"] > 0 and fused[rank]["fused"] % (2 * layers) == 0, fused[rank]["fused"]
    assert plain[0]["tokens"] == plain[1]["tokens"]


def test_the_all_reduce_choice_is_validated(monkeypatch):
    from dovetail.errors import ConfigError
    from dovetail_cuda.symm_mem_all_reduce import all_reduce_choice, all_reduce_kernel

    monkeypatch.delenv("DOVETAIL_ALL_REDUCE", raising=False)
    assert all_reduce_choice() == "auto"
    monkeypatch.setenv("DOVETAIL_ALL_REDUCE", "NCCL")
    assert all_reduce_kernel(None, torch.device("cpu")) is None
    monkeypatch.setenv("DOVETAIL_ALL_REDUCE", "custom")
    with pytest.raises(ConfigError,
                       match=r"^DOVETAIL_ALL_REDUCE='custom': expected one of auto, nccl, symm_mem, flashinfer$"):
        all_reduce_choice()


class FakeNvml:
    """NVML of a host whose GPUs ``GPU-0``.. are joined by NVLink except the pairs in ``unlinked``."""

    def __init__(self, unlinked):
        self.unlinked = {frozenset(pair) for pair in unlinked}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def nvlink_connected(self, uuid, peers):
        return all(frozenset((uuid, peer)) not in self.unlinked for peer in peers if peer != uuid)


def nvlink_vote_job(unlinked: list[tuple[str, str]], sees_all: bool = True) -> bool:
    from dovetail import distributed
    from dovetail_cuda.symm_mem_all_reduce import all_ranks_on_nvlink

    mine = f"GPU-{distributed.tp_rank()}"
    visible = [f"GPU-{r}" for r in range(distributed.tp_size())] if sees_all else [mine]
    return all_ranks_on_nvlink(distributed.tp_group(), mine, visible, lambda: FakeNvml(unlinked))


def test_auto_all_reduce_needs_nvlink_between_every_pair_of_ranks(tp_ranks):
    """``DOVETAIL_ALL_REDUCE=auto`` takes symmetric memory only where every pair of the ranks' GPUs is joined by
    NVLink and every rank sees them all, and every rank gets the same answer even where only some ranks see a
    missing link."""
    ranks = tp_ranks(4)
    assert ranks.run(nvlink_vote_job, []) == [True] * 4
    assert ranks.run(nvlink_vote_job, [("GPU-1", "GPU-3")]) == [False] * 4, "ranks 1 and 3 see it; all agree"
    assert ranks.run(nvlink_vote_job, [], False) == [False] * 4, "a rank that sees only its own GPU (Ray)"


def fused_kernels_vote_job(failing_rank: int, choice: str | None = None):
    """On each rank: whether every rank has FlashInfer's fused kernels when ``failing_rank`` cannot load them
    (with ``choice``: what ``all_reduce_kernel`` makes of that instead, or the error it raises)."""
    import os

    from dovetail import distributed
    from dovetail_cuda import flashinfer_all_reduce
    from dovetail_cuda.symm_mem_all_reduce import all_reduce_kernel

    original = flashinfer_all_reduce.load_fused_kernels
    flashinfer_all_reduce.load_fused_kernels = lambda compile=True: (
        "no CUDA compiler" if distributed.tp_rank() == failing_rank else None)
    try:
        if choice is None:
            return flashinfer_all_reduce.fused_kernels_on_every_rank(distributed.tp_group())
        os.environ["DOVETAIL_ALL_REDUCE"] = choice
        try:
            return all_reduce_kernel(distributed.tp_group(), torch.device("cpu"))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    finally:
        flashinfer_all_reduce.load_fused_kernels = original
        os.environ.pop("DOVETAIL_ALL_REDUCE", None)


def test_the_fused_all_reduce_is_taken_only_where_every_rank_has_it(tp_ranks):
    """``auto`` fuses the all-reduce with the norms only where FlashInfer's kernels load on every rank; every rank
    gets the same answer, and ``flashinfer`` asked for where a rank lacks them is a one-line error."""
    from dovetail_cuda.flashinfer_all_reduce import load_fused_kernels

    ranks = tp_ranks(2)
    assert ranks.run(fused_kernels_vote_job, -1) == [None, None]
    assert ranks.run(fused_kernels_vote_job, 1) == ["no CUDA compiler"] * 2, "rank 1 lacks them; both agree"
    assert ranks.run(fused_kernels_vote_job, 0, "flashinfer") == [
        "ConfigError: DOVETAIL_ALL_REDUCE=flashinfer: no CUDA compiler"] * 2
    reason = load_fused_kernels()  # here: no GPU, and FlashInfer may be absent
    assert reason is None or reason.startswith("FlashInfer's communication kernels")


class FakeCommModule:
    """Stands for FlashInfer's modules: whether the kernels are built, and each time they are loaded."""

    def __init__(self, built: bool):
        self.built, self.loads = built, 0

    def install(self, monkeypatch):
        import sys
        import types

        jit_comm = types.ModuleType("flashinfer.jit.comm")
        jit_comm.gen_trtllm_comm_module = lambda: types.SimpleNamespace(is_compiled=self.built)
        trtllm_ar = types.ModuleType("flashinfer.comm.trtllm_ar")
        trtllm_ar.get_trtllm_comm_module = self.load
        for name, module in (("flashinfer", types.ModuleType("flashinfer")),
                             ("flashinfer.jit", types.ModuleType("flashinfer.jit")), ("flashinfer.jit.comm", jit_comm),
                             ("flashinfer.comm", types.ModuleType("flashinfer.comm")),
                             ("flashinfer.comm.trtllm_ar", trtllm_ar)):
            monkeypatch.setitem(sys.modules, name, module)

    def load(self):
        self.loads += 1
        self.built = True


@pytest.mark.parametrize("built", [False, True], ids=["not built", "built"])
def test_auto_never_waits_for_flashinfer_to_compile(monkeypatch, built):
    """``auto`` takes FlashInfer's fused kernels only where they are built already (compiling them takes minutes,
    which no start should wait for unasked); ``flashinfer`` compiles them. The NVLink checks pass here."""
    import types

    from dovetail.errors import ConfigError
    from dovetail_cuda import flashinfer_all_reduce, symm_mem_all_reduce

    fake = FakeCommModule(built)
    fake.install(monkeypatch)
    assert flashinfer_all_reduce.load_fused_kernels(compile=False) == (None if built else
                                                                       flashinfer_all_reduce.NOT_COMPILED)
    assert fake.loads == (1 if built else 0), "auto loads built kernels and compiles none"
    assert flashinfer_all_reduce.load_fused_kernels() is None and fake.loads == (2 if built else 1)
    assert flashinfer_all_reduce.load_fused_kernels(compile=False) is None, "compiled once, auto takes them"

    asked = []
    monkeypatch.setattr(flashinfer_all_reduce, "fused_kernels_on_every_rank",
                        lambda group, compile=True: asked.append(compile) or flashinfer_all_reduce.NOT_COMPILED)
    monkeypatch.setattr(symm_mem_all_reduce, "torch_has_kernels", lambda: True)
    monkeypatch.setattr(symm_mem_all_reduce, "all_ranks_on_nvlink", lambda *args: True)
    monkeypatch.setattr(symm_mem_all_reduce, "device_uuid", lambda device: "GPU-0")
    plain = types.SimpleNamespace(max_bytes=1 << 20, one_shot_max_bytes=1 << 18)
    monkeypatch.setattr(symm_mem_all_reduce, "SymmMemAllReduce", lambda group, device: plain)
    monkeypatch.setenv("DOVETAIL_ALL_REDUCE", "auto")
    assert symm_mem_all_reduce.all_reduce_kernel(None, torch.device("cpu")) is plain, "unfused"
    monkeypatch.setenv("DOVETAIL_ALL_REDUCE", "flashinfer")
    with pytest.raises(ConfigError, match="DOVETAIL_ALL_REDUCE=flashinfer: FlashInfer's communication kernels are not"):
        symm_mem_all_reduce.all_reduce_kernel(None, torch.device("cpu"))
    assert asked == [False, True], "auto asks for built kernels only; flashinfer compiles"


def greedy_from_shards_job(vocab: int, ties: bool) -> dict:
    """On each rank: the LM head's greedy tokens from its vocabulary columns, and the argmax of the gathered
    logits. Every logit is negative, so the last rank's padding columns (zero) would win if they counted; with
    ``ties`` two columns held by different ranks share each row's maximum."""
    from dovetail.layers.embedding import LMHead

    gen = torch.Generator().manual_seed(1)
    hidden = torch.rand(6, HIDDEN, generator=gen) + 0.1
    weight = -torch.rand(vocab, HIDDEN, generator=gen)
    if ties:
        weight[2] = weight[vocab - 1] = 0.0
        weight[:, 0] -= 1.0  # tokens 2 and 12 share the largest logit, -hidden[0]; the first one wins
    head = LMHead(vocab, HIDDEN, _ctx())
    head.shard.load(head.weight, weight, "lm_head")
    local = head(hidden, gather=False)
    return {"sharded": head.greedy_tokens(local), "gathered": head(hidden).argmax(dim=-1),
            "padding_cols": local.shape[1] - (head.shard.end - head.shard.start),
            "dense": (hidden @ weight.T).argmax(dim=-1)}


@pytest.mark.parametrize("ties", [False, True])
def test_greedy_tokens_from_vocabulary_shards_match_the_gathered_argmax(tp_ranks, ties):
    """13 tokens over two ranks: rank 1 holds six and a padding column; the tokens picked from the shards are the
    argmax of the whole row (and its first maximum where two ranks tie)."""
    results = tp_ranks(2).run(greedy_from_shards_job, VOCAB, ties)
    assert [r["padding_cols"] for r in results] == [0, 1]
    for got in results:
        torch.testing.assert_close(got["sharded"], got["gathered"])
        torch.testing.assert_close(got["sharded"], got["dense"])
    if ties:
        assert results[0]["sharded"].tolist() == [2] * 6
