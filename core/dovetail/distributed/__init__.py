"""Tensor parallelism: the process group of this rank and the collectives the layers call."""

from dovetail.distributed.parallel_state import (
    all_gather, all_reduce, all_reduce_add_rms_norm, all_reduce_kernel_name, backend_collectives,
    destroy_tensor_parallel, init_tensor_parallel, is_initialized, set_all_reduce_kernel, tp_group, tp_rank, tp_size,
)

__all__ = ["all_gather", "all_reduce", "all_reduce_add_rms_norm", "all_reduce_kernel_name", "backend_collectives",
           "destroy_tensor_parallel", "init_tensor_parallel", "is_initialized", "set_all_reduce_kernel", "tp_group",
           "tp_rank", "tp_size"]
