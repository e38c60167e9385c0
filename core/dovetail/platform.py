"""The Platform contract: what Dovetail asks of a kind of hardware.

A vendor subclasses :class:`Platform` and registers it with the
``register_platforms`` hook (see :mod:`dovetail.hookspecs`). The engine asks the
selected platform for its device, its memory, its dtypes, its preferred
attention backends and its distributed backend; nothing in the core names a
vendor.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, TypeVar

logger = logging.getLogger("dovetail")

if TYPE_CHECKING:
    import torch

    from dovetail.config import EngineConfig
    from dovetail.ops import FusedOps


_T = TypeVar("_T")


class DeviceGraph(ABC):
    """Device work recorded once and replayed (a CUDA graph).

    A replay re-runs the recorded kernels on the same memory: the caller writes
    the next step's inputs into the buffers the capture read, replays, and reads
    the outputs the capture returned.
    """

    @abstractmethod
    def replay(self) -> None:
        """Run the recorded work again."""


def kv_cache_budget(total: int, free: int, reserved: int, peak: int, utilization: float, reserve: int = 0) -> int:
    """Bytes for the KV cache: ``total * utilization`` less the profiled peak, the memory held outside
    torch's allocator (``total - free - reserved``: the driver's context, communication libraries,
    other processes) and ``reserve``. A budget of zero or less is an error naming ``gpu_memory_utilization``.
    """
    outside_torch = max(0, total - free - reserved)
    budget = int(total * utilization) - peak - outside_torch - reserve
    if budget <= 0:
        from dovetail.errors import ConfigError

        gib = 2**30
        raise ConfigError(f"gpu_memory_utilization: {utilization} leaves no memory for the KV cache (profiled "
                          f"peak {peak / gib:.2f} GiB, {outside_torch / gib:.2f} GiB used outside torch, "
                          f"{reserve / gib:.2f} GiB graph reserve, of {total / gib:.2f} GiB); raise it, or "
                          "lower max_num_batched_tokens")
    return budget


class HostCopy:
    """A device-to-host copy in flight; :meth:`wait` returns the host tensor once it has landed."""

    def __init__(self, tensor: "torch.Tensor"):
        self._tensor = tensor

    def wait(self) -> "torch.Tensor":
        return self._tensor.cpu()


@dataclass(frozen=True)
class ProbeResult:
    """Whether a platform is usable on this machine, and if not, why."""

    usable: bool
    reason: str = ""

    @classmethod
    def ok(cls, detail: str = "") -> "ProbeResult":
        return cls(True, detail)

    @classmethod
    def no(cls, reason: str) -> "ProbeResult":
        return cls(False, reason)


#: The allocator counts :meth:`Platform.memory_stats` may report beside its byte figures.
ALLOCATOR_COUNTS = ("alloc_retries", "device_allocs", "device_frees", "host_allocs", "host_alloc_us")


class Platform(ABC):
    """A kind of hardware Dovetail can run on.

    Class attributes to set:

    - ``name``: the name users type (``--device``), e.g. ``"cuda"``.
    - ``device_type``: the torch device type tensors live on, e.g. ``"cuda"``.
      A platform may compute on another platform's device type (a vendor's
      emulator on ``"cpu"``).
    - ``dist_backend``: the torch.distributed backend, e.g. ``"nccl"``.
    - ``is_accelerator``: True when the KV cache is sized by a profiling run and
      ``gpu_memory_utilization``; False when it is a byte budget
      (``kv_cache_memory_bytes``), as on the CPU.
    - ``supports_graph_capture``: whether decode steps can be captured and
      replayed (CUDA graphs); the engine disables capture otherwise.
    - ``ray_device_key``: the Ray resource a rank's actor reserves (``"GPU"``).
    - ``visible_devices_env``: the variable that limits which devices a
      process sees (``CUDA_VISIBLE_DEVICES``), or None. Ray gives each actor
      only its own device; where this is set, the ``ray`` executor widens it
      so that the actors on one machine see each other's devices, which a
      peer-to-peer all-reduce needs.

    The engine makes one instance per process, after selection, with no
    arguments. The constructor may touch the device; the class body and the
    probe must not.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    #: Where this implementation was verified, or what was never run (shown by ``dovetail plugins``).
    verification: ClassVar[str] = ""
    dist_backend: ClassVar[str] = "gloo"
    is_accelerator: ClassVar[bool] = True
    supports_graph_capture: ClassVar[bool] = False
    #: Bytes the KV-cache sizing leaves free for captured graphs (when not ``enforce_eager``).
    graph_memory_reserve: ClassVar[int] = 0
    #: The Ray resource one rank takes (``GPU``, ``CPU`` or a custom resource) under ``--distributed-executor-backend ray``.
    ray_device_key: ClassVar[str] = "GPU"
    #: The environment variable naming the devices a process sees (None: Ray's one device per actor stays).
    visible_devices_env: ClassVar[str | None] = None

    # -- discovery -------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def probe(cls) -> ProbeResult:
        """Say cheaply whether this platform is usable here, without initialising a device."""

    # -- devices and memory -----------------------------------------------------------

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this platform visible to the process."""

    def check_world_size(self, world_size: int) -> None:
        """Refuse ``world_size`` ranks (one process per device on this host) when fewer devices are visible.

        Raise :class:`dovetail.errors.ConfigError` naming both counts. Platforms whose ranks share
        a device (the CPU, where a rank is a process) accept any size.
        """
        count = self.device_count()
        if world_size > count:
            from dovetail.errors import ConfigError

            raise ConfigError(f"tensor_parallel_size: {world_size} ranks need {world_size} {self.name} devices, "
                              f"but {count} {'is' if count == 1 else 'are'} visible")

    def device(self, index: int = 0) -> "torch.device":
        """The torch device for device ``index``."""
        import torch

        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def set_device(self, index: int = 0) -> None:
        """Make device ``index`` current for this process (no-op by default)."""

    @abstractmethod
    def memory_total(self, index: int | None = None) -> int:
        """Total memory of device ``index`` (None: the current device) in bytes."""

    @abstractmethod
    def memory_free(self, index: int | None = None) -> int:
        """Free memory of device ``index`` (None: the current device) in bytes."""

    def memory_stats(self, index: int | None = None) -> dict[str, int]:
        """Allocator statistics: at least ``allocated`` and ``peak_allocated`` (bytes) when known; where the
        allocator counts them, ``alloc_retries`` (allocations that first had to give cached memory back to the
        device, which waits for it), ``device_allocs`` and ``device_frees``; ``host_allocs`` and ``host_alloc_us``
        for pinned host memory (blocks made, microseconds spent making them)."""
        return {}

    def default_batch_limits(self, usage: str) -> tuple[int, int]:
        """``(max_num_batched_tokens, max_num_seqs)`` for a user who sets neither.

        ``usage`` is ``"llm"`` (the offline :class:`~dovetail.LLM`) or ``"server"``. The default is
        vLLM's for devices under 70 GiB; platforms with large devices return larger budgets.
        """
        return 8192, 256

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Start a new peak-memory measurement (used by the profiling run)."""

    def multiprocessor_count(self, index: int | None = None) -> int:
        """Independent compute units of device ``index`` (None: the current device) that a kernel's programs
        spread over: multiprocessors, compute units, subslices. The core's Triton kernels size their grids by it
        (KV splits of decode attention); 0, the default, means unknown and they assume 64."""
        return 0

    def supports_pdl(self, index: int | None = None) -> bool:
        """Whether device ``index`` (None: the current one) runs the core's Triton kernels with programmatic
        dependent launch (``triton.language.extra.cuda.gdc_wait``; NVIDIA Hopper and newer). False by default."""
        return False

    def copy_to_host_async(self, tensor: "torch.Tensor") -> HostCopy:
        """Start copying ``tensor`` to the host without waiting for work queued after it.

        The engine overlaps the next step's scheduling with the device through this:
        override it (pinned memory plus an event) on devices that run asynchronously.
        The default copies when :meth:`HostCopy.wait` is called.
        """
        return HostCopy(tensor)

    def synchronize(self) -> None:
        """Wait for every queued operation on the device to finish."""

    def empty_cache(self) -> None:
        """Return cached, unused allocator memory to the device."""

    # -- numerics ----------------------------------------------------------------------

    @abstractmethod
    def supported_dtypes(self) -> list["torch.dtype"]:
        """Activation dtypes this platform computes in, best first."""

    def resolve_dtype(self, checkpoint_dtype: "torch.dtype | None") -> "torch.dtype":
        """The dtype ``dtype="auto"`` means here for a checkpoint saved in ``checkpoint_dtype``."""
        supported = self.supported_dtypes()
        return checkpoint_dtype if checkpoint_dtype in supported else supported[0]

    def fused_ops(self) -> "FusedOps":
        """The fused operations models call (dense linear, RMSNorm with residual, rotary, SiLU-and-mul, MoE).

        Return a :class:`dovetail.ops.FusedOps` subclass instance overriding the
        operations this platform does faster; the default is plain torch.
        """
        from dovetail.ops import FusedOps

        return FusedOps()

    def quant_kernels(self):
        """The kernels quantization methods call here (see :mod:`dovetail.quantization.kernels`).

        Return a :class:`~dovetail.quantization.kernels.QuantKernels` subclass
        instance overriding what this platform does faster; the default is plain torch.
        """
        from dovetail.quantization.kernels import QuantKernels

        return QuantKernels()

    def all_reduce_kernel(self, group, device: "torch.device") -> "Callable[[torch.Tensor], bool] | None":
        """A faster all-reduce than ``dist_backend``'s for the messages it takes, or None (the default).

        Called on every rank of a group of several, after it is formed, with its process group; the
        result goes to :func:`dovetail.distributed.set_all_reduce_kernel`: ``kernel(tensor)`` sums
        ``tensor`` over the group in place and returns True, or returns False for a tensor it does not
        take. It must come from a maintained library, be capturable in device graphs, never read device
        values on the host, and never use NVLink multicast (``NCCL_NVLS_ENABLE=0``,
        ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` must hold).

        A kernel may also offer ``add_rms_norm(x, residual, weight, eps)``: the sum of ``x`` over the group,
        plus ``residual``, then RMSNorm with ``weight``, returned as ``(normed, summed)`` in one pass (None for
        what it does not take). Models built on the Llama decoder layer leave their row-parallel outputs
        unreduced and sum them in the norm that follows, through it
        (:func:`dovetail.distributed.all_reduce_add_rms_norm`).
        """
        return None

    def micro_batches_context(self) -> contextlib.AbstractContextManager:
        """Entered while a step runs as two overlapped micro-batches (dual-batch overlap,
        :mod:`dovetail.engine.micro_batches`): a platform whose fastest matrix-product kernels hold every
        compute unit until they finish switches to kernels that leave room for the other part's collectives.
        The default changes nothing."""
        return contextlib.nullcontext()

    # -- engine integration ------------------------------------------------------------

    @abstractmethod
    def default_attention_backends(self) -> list[str]:
        """Attention backend names to try, most preferred first (installed or not): the fastest valid backend
        first, by what was measured on this hardware (say why in :meth:`attention_backend_order_reason`)."""

    def attention_backend_order_reason(self) -> str:
        """Why :meth:`default_attention_backends` is in its order here: the measurement it rests on (with where
        it is recorded), or that none was made. ``dovetail plugins`` shows it."""
        return ""

    def check_and_update_config(self, config: "EngineConfig") -> None:
        """Check the engine config against this platform and adjust what it must.

        Raise :class:`dovetail.errors.ConfigError` naming the field for a value the
        platform cannot honour; adjust silently only what the user did not set,
        and log every adjustment.
        """

    def kv_cache_bytes(self, config: "EngineConfig", profile: Callable[[], int]) -> int:
        """Bytes to give the KV cache on one device.

        ``profile()`` runs the model once on the largest batch the scheduler can
        form and returns the peak bytes it used. The default, for accelerators, is
        :func:`kv_cache_budget` of this device's memory, keeping
        ``graph_memory_reserve`` free unless ``enforce_eager``.
        """
        self.empty_cache()
        peak = profile()
        total, free = self.memory_total(), self.memory_free()
        reserved = self.memory_stats().get("reserved", 0)
        reserve = 0 if config.device.enforce_eager else self.graph_memory_reserve
        budget = kv_cache_budget(total, free, reserved, peak, config.cache.gpu_memory_utilization, reserve)
        logger.info("%s: KV cache gets %.2f GiB = %.2f GiB total x %.2f - %.2f GiB profiled peak - %.2f GiB "
                    "outside torch - %.2f GiB graph reserve", self.name, budget / 2**30, total / 2**30,
                    config.cache.gpu_memory_utilization, peak / 2**30, max(0, total - free - reserved) / 2**30,
                    reserve / 2**30)
        return budget

    # -- graphs (only asked when ``supports_graph_capture``) ------------------------------

    def graph_pool(self) -> Any:
        """A memory pool that several graphs captured one after another share (``None``: a pool per graph)."""
        return None

    def capture_graph(self, fn: Callable[[], _T], pool: Any = None) -> tuple[DeviceGraph, _T]:
        """Record the device work ``fn()`` launches; return the graph and ``fn``'s result.

        The tensors in the result are the graph's outputs: each :meth:`DeviceGraph.replay`
        rewrites them. The caller runs ``fn`` once before capturing (warm-up).
        """
        raise NotImplementedError(f"platform {self.name!r} does not capture device graphs")

    def seed_everything(self, seed: int) -> None:
        """Seed this platform's random generators."""
        import torch

        torch.manual_seed(seed)

    def describe(self) -> str:
        """A one-line description of the devices (for logs and ``dovetail plugins``)."""
        return self.name
