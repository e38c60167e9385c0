"""The Dovetail plugin contract.

This module is the whole plugin surface of Dovetail, and its docstrings are the
vendor documentation. A plugin is an importable module, named by an entry point
in the group ``dovetail`` of its distribution::

    [project.entry-points.dovetail]
    acme = "dovetail_acme.plugin"

The module must declare which versions of the contract it was written for, as a
PEP 440 specifier over :data:`dovetail.PLUGIN_API_VERSION`::

    DOVETAIL_PLUGIN_API = ">=1.0,<2"

and implements any of the hooks below with :data:`hookimpl`::

    from dovetail.hookspecs import hookimpl

    @hookimpl
    def register_platforms(register):
        register(
            name="acme",
            cls="dovetail_acme.platform:AcmePlatform",
            probe="dovetail_acme.probe:probe",
            priority=50,
        )

Every registration names its implementation lazily as a ``"module:attribute"``
string. Importing the plugin module must stay cheap: it must not import device
runtimes nor touch device state (no CUDA context, no device enumeration). The
class is imported only when it is selected or inspected (``dovetail plugins``).

Hooks are called once, at start-up, to collect registrations; pluggy is never on
a hot path. After loading, unknown ``@hookimpl`` names are an error
(``check_pending``), so a misspelled hook does not go unnoticed.

The abstract classes a plugin implements live in:

- :mod:`dovetail.platform` -- :class:`~dovetail.platform.Platform`
- :mod:`dovetail.attention.backend` --
  :class:`~dovetail.attention.backend.AttentionBackend`,
  :class:`~dovetail.attention.backend.AttentionImpl`
- :mod:`dovetail.quantization.base` -- :class:`~dovetail.quantization.base.QuantMethod`
- :mod:`dovetail.model_interface` -- :class:`~dovetail.model_interface.DovetailModel`

Where a platform makes models fast -- the speed surface for vendors. The core computes everything in
plain torch unless the selected platform returns something faster:

- ``Platform.fused_ops()`` -- a :class:`dovetail.ops.FusedOps` subclass: the dense linear layers and LM
  head (``linear``), RMSNorm with the residual add, rotary (with per-head q/k norms), the gated
  activations, the mixture-of-experts layer (routing, ``select_experts``; the experts, ``fused_moe``; both at
  once, ``routed_moe``, which composes the two unless overridden; ``routed_moe_unsummed`` with
  ``add_rms_norm_experts`` to leave the experts' weighted sum to the norm after the layer) and
  greedy sampling's ``argmax``. Every model layer calls these; override what the hardware does faster.
  GPU platforms built on :class:`dovetail.torch_device_platform.TorchDevicePlatform` get the core's Triton kernels
  (:class:`dovetail.triton.fused_ops.TritonFusedOps`) and may tune them (``gemv_max_rows``).
- ``Platform.quant_kernels()`` -- a :class:`dovetail.quantization.kernels.QuantKernels` subclass: the
  products of the quantized formats (FP8, INT8, GPTQ/AWQ) that every quantization method calls, and
  ``fp8_linear_gated`` for a projection fused with its activation.
- The attention backends registered for the platform (``register_attention_backends``).
- Questions the core's Triton kernels ask about a device, answered by its platform:
  ``Platform.multiprocessor_count`` (how wide a launch must be to fill it) and ``Platform.supports_pdl``
  (programmatic dependent launch). The core never asks the vendor's runtime itself.

The conformance kit :mod:`dovetail.testing` checks an implementation against the
contract and against the ``REFERENCE`` backend.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "dovetail"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class DovetailHookSpecs:
    """The hooks a Dovetail plugin may implement (all optional)."""

    @hookspec
    def register_platforms(self, register):
        """Register hardware platforms.

        Call ``register(name, cls, probe=None, priority=0)`` once per platform:

        - ``name``: the name users type (``--device NAME``), e.g. ``"cuda"``.
        - ``cls``: ``"module:Class"`` of a :class:`dovetail.platform.Platform`
          subclass.
        - ``probe``: ``"module:function"`` of a cheap function taking no arguments
          and returning a :class:`dovetail.platform.ProbeResult` -- whether the
          platform is usable on this machine, and if not, why. It must not
          initialise a device runtime in the calling process (use NVML, sysfs, or
          a subprocess). When omitted, the class's ``probe`` classmethod is used,
          which imports the class module.
        - ``priority``: among usable platforms, auto-selection takes the highest.
          Accelerators use 100 or more; the CPU uses 0. Two usable platforms of
          equal highest priority are an error asking the user to choose with
          ``--device``.
        """

    @hookspec
    def register_attention_backends(self, register):
        """Register attention backends.

        Call ``register(name, cls, platforms, priority=0)`` once per backend:

        - ``name``: the name users type (``--attention-backend NAME``), upper
          case by convention, e.g. ``"FLASHINFER"``.
        - ``cls``: ``"module:Class"`` of a
          :class:`dovetail.attention.backend.AttentionBackend` subclass.
        - ``platforms``: names of the platforms the backend can run on, e.g.
          ``("cuda",)``; ``("*",)`` means every platform.
        - ``priority``: used to order backends that the platform's own
          :meth:`~dovetail.platform.Platform.default_attention_backends` does not
          name; higher is tried first.
        """

    @hookspec
    def register_quantization_methods(self, register):
        """Register quantization methods.

        Call ``register(name, cls)`` once per method:

        - ``name``: the name users type (``--quantization NAME``) and the value
          of ``quantization_config.quant_method`` in checkpoints it reads, e.g.
          ``"fp8"``.
        - ``cls``: ``"module:Class"`` of a
          :class:`dovetail.quantization.base.QuantMethod` subclass.
        """

    @hookspec
    def register_models(self, register):
        """Register model architectures.

        Call ``register(architecture, cls, priority=0)`` once per architecture:

        - ``architecture``: the HF name found in ``config.json``'s
          ``architectures`` list, e.g. ``"LlamaForCausalLM"``.
        - ``cls``: ``"module:Class"`` of a
          :class:`dovetail.model_interface.DovetailModel` subclass.
        - ``priority``: when several plugins register the same architecture,
          the highest priority wins (the built-in zoo uses 0), so an
          out-of-tree plugin replaces a built-in model by registering it with a
          higher priority. The log says which implementation was used.
        """
