"""The tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it, through FlashInfer's
TensorRT-LLM kernels (``DOVETAIL_ALL_REDUCE=flashinfer``).

Each row-parallel layer's partial sum is followed by ``add_rms_norm(sum, residual)``; summed apart, that is
two kernels and a round trip of the sum through memory per layer and block. FlashInfer's
``trtllm_allreduce_fusion`` does all three in one kernel: each rank writes its partial sum into every peer's
buffer (Lamport flags in the data, so no barrier round trip), then sums what arrived, adds the residual and
normalises. Its buffers are torch symmetric memory (peer memory over NVLink; multicast is never used). Plain
all-reduces (the embedding's, other models' layers) stay on :class:`SymmMemAllReduce`.
"""

from __future__ import annotations

import logging

import torch

from dovetail_cuda.symm_mem_all_reduce import SymmMemAllReduce

logger = logging.getLogger("dovetail")

#: Largest fused message: every decode batch (256 sequences of hidden 8,192 are 4 MiB) and short prefill chunks.
FUSED_MAX_BYTES = 8 << 20
#: The workspace is sized by tokens x hidden; FlashInfer checks only the product, so one serves every model.
_WORKSPACE_HIDDEN = 1024


#: Why ``auto`` passes over kernels that would have to be compiled first.
NOT_COMPILED = ("FlashInfer's communication kernels are not compiled on this machine yet, and compiling them takes "
                "minutes; start once with DOVETAIL_ALL_REDUCE=flashinfer to compile them (FlashInfer keeps them in "
                "~/.cache/flashinfer), and later starts fuse")


def load_fused_kernels(compile: bool = True) -> str | None:
    """Import FlashInfer's communication kernels, compiling them first where they are not built yet (minutes, once:
    FlashInfer caches them on disk) unless ``compile`` is False; None when they load, else why not."""
    try:
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module
        from flashinfer.jit.comm import gen_trtllm_comm_module
    except Exception as exc:  # FlashInfer absent, or cuda-python or NVML missing
        return f"FlashInfer's communication kernels cannot be imported ({exc})"
    try:
        if not compile and not gen_trtllm_comm_module().is_compiled:
            return NOT_COMPILED
        get_trtllm_comm_module()
    except Exception as exc:  # no CUDA compiler, or a GPU it does not build for
        return f"FlashInfer's communication kernels do not build here ({exc})"
    return None


def fused_kernels_on_every_rank(group, compile: bool = True) -> str | None:
    """:func:`load_fused_kernels` on every rank of ``group``, which all take the same answer (a collective):
    None when every rank has them, else the first reason a rank gave."""
    import torch.distributed as dist

    logger.info("cuda: loading FlashInfer's fused all-reduce kernels%s",
                " (compiling them where they are not built yet: minutes, once)" if compile else "")
    reasons: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, load_fused_kernels(compile), group=group)
    return next((reason for reason in reasons if reason is not None), None)


class FlashInferFusedAllReduce:
    """``kernel(tensor)`` sums through :class:`SymmMemAllReduce`; ``add_rms_norm(x, residual, weight, eps)`` sums
    ``x`` over the group, adds ``residual`` and applies RMSNorm in one FlashInfer kernel, returning
    ``(normed, summed)``, for bfloat16 messages of at most ``max_bytes`` (None for others: the caller takes
    the two steps).

    Building it is a collective (the buffers' rendezvous); every rank of ``group`` must build one. The first
    build compiles FlashInfer's kernels (cached on disk afterwards). ``one_shot``: True or False forces FlashInfer's
    one-shot (each rank pushes its whole message to every peer) or two-shot (reduce-scatter, then all-gather)
    kernel; None, the default, lets FlashInfer choose by size (``benchmarks/kernels_all_reduce.py`` times both).
    """

    def __init__(self, group, device: torch.device, plain: SymmMemAllReduce | None = None,
                 max_bytes: int = FUSED_MAX_BYTES, one_shot: bool | None = None):
        import torch.distributed as dist
        from flashinfer.comm import AllReduceFusionPattern, trtllm_allreduce_fusion
        from flashinfer.comm import trtllm_create_ipc_workspace_for_all_reduce_fusion as create_workspace

        from dovetail.triton.pdl import use_pdl

        self.plain = plain if plain is not None else SymmMemAllReduce(group, device)
        self.device, self.max_bytes, self.one_shot = device, max_bytes, one_shot
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._fuse = trtllm_allreduce_fusion
        self._pattern = AllReduceFusionPattern.kARResidualRMSNorm
        self._pdl = use_pdl(device)
        with torch.cuda.device(device):
            # (peer pointers, the device table of them, the symmetric-memory handles, sizes): kept for their life.
            self._workspace = create_workspace(self.rank, self.world_size, max_bytes // 2 // _WORKSPACE_HIDDEN,
                                               _WORKSPACE_HIDDEN, group=group, create_metadata=True,
                                               use_symm_dev_mem=True)
        self._pointers = self._workspace[1]

    def __call__(self, tensor: torch.Tensor) -> bool:
        return self.plain(tensor)

    def takes(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype == torch.bfloat16 and residual.dtype == x.dtype and weight.dtype == x.dtype
                and residual.shape == x.shape and x.is_contiguous() and residual.is_contiguous()
                and weight.is_contiguous() and x.device == self.device and x.shape[1] % 8 == 0
                and 0 < x.numel() * 2 <= self.max_bytes
                and (self.one_shot is not False or x.shape[0] > self.world_size))  # two-shot splits the rows

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        if not self.takes(x, residual, weight):
            return None
        tokens, hidden = x.shape
        normed, summed = torch.empty_like(x), torch.empty_like(residual)
        self._fuse(allreduce_in=x, world_size=self.world_size, world_rank=self.rank, token_num=tokens,
                   hidden_dim=hidden, workspace_ptrs=self._pointers, launch_with_pdl=self._pdl,
                   trigger_completion_at_end=True, fp32_acc=True, pattern_code=self._pattern, use_oneshot=self.one_shot,
                   allreduce_out=None, residual_in=residual, residual_out=summed, norm_out=normed, quant_out=None,
                   scale_out=None, rms_gamma=weight, rms_eps=float(eps), scale_factor=None, layout_code=None)
        return normed, summed
