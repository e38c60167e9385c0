"""Run a ``dovetail`` command with the Triton GEMV's default launch parameters changed, to tune them end to end.

``python3 benchmarks/with_gemv_config.py fp8.block_n=128 -- bench latency --model llama-3.1-8b``
runs ``dovetail bench latency ...`` in this process with every FP8 result of
:func:`dovetail.triton.gemv.default_config` given ``block_n=128`` (any :class:`~dovetail.triton.gemv.GemvConfig`
field, integer values; ``FIELD=V`` for both weight kinds, ``bf16.FIELD=V`` for 16-bit weights). Unless ``split_k``
is set too, a changed tensor-core tile takes the split :func:`~dovetail.triton.gemv.split_k_for` gives it.
Register sums (``dot=0``) keep their accumulator within 64 values a thread: at more rows, ``block_k`` shrinks.
CUDA graphs capture the changed kernels.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from dovetail.cli.main import main as dovetail_main  # noqa: E402
from dovetail.triton import gemv as gemv_module  # noqa: E402


def override(changes: dict[tuple[int | None, str], int]) -> None:
    """Wrap ``gemv_module.default_config``: (weight bytes or None for both, field) -> value."""
    original = gemv_module.default_config

    def default_config(m, n, k, weight_bytes=1):
        cfg = original(m, n, k, weight_bytes)
        fields = {field: value for (kind, field), value in changes.items() if kind in (None, weight_bytes)}
        if cfg.dot and "split_k" not in fields and ({"block_n", "block_k"} & fields.keys()):
            fields["split_k"] = gemv_module.split_k_for(n, k, fields.get("block_n", cfg.block_n),
                                                        fields.get("block_k", cfg.block_k))
        cfg = cfg._replace(**fields)
        rows = gemv_module.next_power_of_2(m)
        limit = 64 * 32 * cfg.num_warps
        if not cfg.dot and rows * cfg.block_n * cfg.block_k > limit:
            cfg = cfg._replace(block_k=max(16, limit // (rows * cfg.block_n)))
        return cfg

    gemv_module.default_config = default_config


def parse(spec: str) -> tuple[tuple[int | None, str], int]:
    key, value = spec.split("=")
    kind, _, field = key.rpartition(".")
    if field not in gemv_module.GemvConfig._fields or kind not in ("", "fp8", "bf16"):
        raise SystemExit(f"unknown GEMV setting {key!r}: fields are {gemv_module.GemvConfig._fields}")
    return ({"": None, "fp8": 1, "bf16": 2}[kind], field), int(value)


if __name__ == "__main__":
    split = sys.argv.index("--")
    override(dict(parse(spec) for spec in sys.argv[1:split]))
    sys.exit(dovetail_main(sys.argv[split + 1:]))
