"""Dovetail: an LLM inference and serving engine whose hardware and models are plugins.

``import dovetail`` is cheap and touches no device: the engine classes are loaded
on first use.
"""

__version__ = "0.1.0"

#: Version of the plugin contract (:mod:`dovetail.hookspecs`). A plugin declares
#: the range it supports as ``DOVETAIL_PLUGIN_API`` in its module.
PLUGIN_API_VERSION = "1.0"

_LAZY = {
    "LLM": "dovetail.llm:LLM",
    "SamplingParams": "dovetail.sampling_params:SamplingParams",
    "StructuredOutputsParams": "dovetail.sampling_params:StructuredOutputsParams",
    "RequestOutput": "dovetail.outputs:RequestOutput",
    "CompletionOutput": "dovetail.outputs:CompletionOutput",
    "PoolingParams": "dovetail.pooling:PoolingParams",
    "BeamSearchParams": "dovetail.beam_search:BeamSearchParams",
    "EmbeddingRequestOutput": "dovetail.outputs:EmbeddingRequestOutput",
    "EngineArgs": "dovetail.config:EngineArgs",
    "LLMEngine": "dovetail.engine.llm_engine:LLMEngine",
}

__all__ = ["PLUGIN_API_VERSION", "__version__", *_LAZY]


def __getattr__(name):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'dovetail' has no attribute {name!r}")
    import importlib

    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
