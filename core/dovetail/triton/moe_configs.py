"""Tile configurations of the fused MoE, per layer shape and token count: defaults, candidates, a cache on disk.

A :class:`MoeConfig` is the block of rows every expert pads to (``block_m``) and one
:class:`~dovetail.triton.moe_gemm.GemmConfig` per grouped GEMM. Token counts are
bucketed to powers of two (the decode graphs' padded batch sizes fall in the same
bucket as the eager batch they stand for, so both run the same tiles and give the
same numbers).

What decides a good tile is the rows each expert gets, ``tokens * top_k / experts``:

- few rows (decode): the step is a stream of expert weights. ``block_m`` 16 (the
  smallest tensor-core tile) wastes no weight traffic; narrow ``BLOCK_N`` tiles give
  enough programs to fill the GPU (one token of a 128-expert, top-8 layer touches 8
  experts), and deep ``BLOCK_K`` pipelines keep loads in flight.
- many rows (prefill): compute-bound; 64 or 128 rows by 64-256 outputs per program, as a
  dense GEMM tiles.

:func:`default_config` picks from those rules alone. On a GPU (not in triton's
interpreter, and unless ``DOVETAIL_MOE_TUNE=0``) :mod:`dovetail.triton.moe_tuner`
times a handful of candidates per bucket the first time a layer shape runs, and the
winners are kept in ``$DOVETAIL_CACHE_DIR`` (default ``~/.cache/dovetail``) under
``moe/``, one JSON file per GPU kind, triton version and layer shape, so later runs
start at once. Delete the file to tune again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import NamedTuple

from dovetail.triton import next_power_of_2
from dovetail.triton.moe_gemm import GemmConfig

logger = logging.getLogger("dovetail")

#: Most tokens one pass of the fused MoE takes; longer batches run in passes of this many (bounding the
#: ``tokens * top_k`` rows of intermediate results held at once).
MAX_CHUNK_TOKENS = 8192


class MoeConfig(NamedTuple):
    """``block_m`` and the tiles of the gate/up (``up``) and down (``down``) GEMMs."""

    block_m: int
    up: GemmConfig
    down: GemmConfig

    def describe(self) -> str:
        """``block_m 16, up 64x128 g1 w4 s4, down ...``: the tiles (N x K), program grouping, warps and stages."""
        def gemm(c: GemmConfig) -> str:
            return f"{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages}{' tma' if c.tma else ''}"

        return f"block_m {self.block_m}, up {gemm(self.up)}, down {gemm(self.down)}"

    def to_json(self) -> dict:
        return {"block_m": self.block_m, "up": self.up.as_dict(), "down": self.down.as_dict()}

    @classmethod
    def from_json(cls, data: dict) -> "MoeConfig":
        return cls(int(data["block_m"]), GemmConfig(**data["up"]), GemmConfig(**data["down"]))


class LayerShape(NamedTuple):
    """What the best tiles depend on, besides the token count."""

    experts: int
    inter: int
    hidden: int
    top_k: int
    dtype: str
    quant: str  # "none", "fp8" (per channel) or "fp8-b<bn>x<bk>"

    def file_name(self) -> str:
        return (f"E{self.experts}_N{self.inter}_K{self.hidden}_top{self.top_k}_{self.dtype}_{self.quant}"
                .replace("/", "-") + ".json")


def bucket(tokens: int) -> int:
    """The token-count bucket whose tiles ``tokens`` uses."""
    return next_power_of_2(min(max(tokens, 1), MAX_CHUNK_TOKENS))


def buckets_up_to(tokens: int) -> list[int]:
    return [1 << i for i in range(bucket(tokens).bit_length())]


def rows_per_expert(tokens: int, shape: LayerShape) -> float:
    return tokens * shape.top_k / shape.experts


def block_m_candidates(tokens: int, shape: LayerShape) -> list[int]:
    """``block_m`` values worth timing at this bucket (the first is the default): about the rows an expert gets, so
    that most experts fill one block (a second block reads the expert's weights again) without much padding."""
    rows = rows_per_expert(tokens, shape)
    if rows <= 8:
        return [16]
    if rows <= 16:
        return [16, 32]
    if rows <= 32:
        return [32, 16, 64]
    if rows <= 128:
        return [64, 32, 128]
    return [128, 64]


def gemm_candidates(block_m: int, gated: bool, descriptors: bool = False) -> list[GemmConfig]:
    """GEMM tiles worth timing with ``block_m`` (the first is the default). Each fits the 227 KiB of shared memory
    a Hopper multiprocessor gives one program, its software pipeline included (checked by compiling for sm_90).

    ``descriptors`` (weights that :func:`~dovetail.triton.moe_gemm.reads_through_descriptor` takes) adds, from
    ``block_m`` 64 up, each tile once more with its weight tiles read through a tensor descriptor: there the
    GEMMs are compute-bound and bulk copies leave the warps free for the products, while the few rows of
    decode tiles stream their weights as fast either way (``benchmarks/kernels_moe.py --sweep-tiles --tma``)."""
    tiles = _address_tiles(block_m, gated)
    if descriptors and block_m >= 64:
        tiles += [tile._replace(tma=True) for tile in tiles]
    return tiles


def _address_tiles(block_m: int, gated: bool) -> list[GemmConfig]:
    if block_m <= 16:
        return [GemmConfig(64, 128, 1, 4, 4), GemmConfig(32, 128, 1, 4, 4), GemmConfig(32, 256, 1, 4, 3),
                GemmConfig(64, 64, 1, 4, 5), GemmConfig(128, 64, 1, 4, 4), GemmConfig(128, 128, 1, 8, 3),
                GemmConfig(16, 256, 1, 4, 4)]
    if block_m <= 32:
        return [GemmConfig(64, 128, 8, 4, 3), GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4),
                GemmConfig(128, 128, 8, 8, 3)]
    if block_m <= 64:
        if gated:  # two weight tiles per stage
            return [GemmConfig(128, 64, 8, 4, 4), GemmConfig(64, 64, 8, 4, 4), GemmConfig(64, 128, 8, 4, 3),
                    GemmConfig(256, 64, 8, 8, 3)]
        return [GemmConfig(128, 64, 8, 4, 4), GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 128, 8, 8, 3),
                GemmConfig(256, 64, 8, 8, 3), GemmConfig(128, 64, 1, 4, 3)]
    if gated:
        return [GemmConfig(128, 64, 8, 8, 4), GemmConfig(128, 64, 8, 4, 3), GemmConfig(256, 64, 8, 8, 2),
                GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 64, 1, 8, 3), GemmConfig(128, 64, 1, 8, 4)]
    return [GemmConfig(128, 64, 8, 8, 4), GemmConfig(128, 64, 8, 4, 3), GemmConfig(256, 64, 8, 8, 3),
            GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 64, 1, 4, 3)]


def default_config(tokens: int, shape: LayerShape) -> MoeConfig:
    """The first-principles choice for ``tokens`` (see the module docstring)."""
    block_m = block_m_candidates(bucket(tokens), shape)[0]
    return MoeConfig(block_m, gemm_candidates(block_m, True)[0], gemm_candidates(block_m, False)[0])


def cache_dir() -> Path:
    """Where tuned tables are kept: ``$DOVETAIL_CACHE_DIR/moe``, else ``$XDG_CACHE_HOME/dovetail/moe``, else
    ``~/.cache/dovetail/moe``."""
    root = os.environ.get("DOVETAIL_CACHE_DIR")
    if root:
        return Path(root) / "moe"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dovetail" / "moe"


class ConfigTable:
    """The tuned configurations of one GPU kind, per layer shape and bucket, backed by JSON files."""

    def __init__(self, device_key: str, directory: Path | None = None):
        self.directory = (directory or cache_dir()) / device_key
        self.tables: dict[LayerShape, dict[int, MoeConfig]] = {}

    def get(self, shape: LayerShape) -> dict[int, MoeConfig]:
        """The bucket -> config table of ``shape`` (read from disk the first time; empty when none)."""
        if shape not in self.tables:
            self.tables[shape] = self._read(self.directory / shape.file_name())
        return self.tables[shape]

    def store(self, shape: LayerShape, configs: dict[int, MoeConfig],
              fallback: dict[int, MoeConfig] | None = None) -> None:
        """Add tuned ``configs`` to the table and its file; ``fallback`` configurations (where tuning failed) are
        used by this process only, so that a later start tunes them again."""
        table = self.get(shape)
        table.update(configs)
        for tokens, config in (fallback or {}).items():
            table.setdefault(tokens, config)
        if not configs:
            return
        path = self.directory / shape.file_name()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            saved = {**self._read(path), **configs}
            tmp.write_text(json.dumps({str(b): c.to_json() for b, c in sorted(saved.items())}, indent=1))
            tmp.replace(path)
        except OSError as exc:
            logger.warning("fused MoE: cannot save tuned tiles to %s (%s); they hold for this process only", path, exc)

    @staticmethod
    def _read(path: Path) -> dict[int, MoeConfig]:
        if not path.exists():
            return {}
        try:
            return {int(b): MoeConfig.from_json(c) for b, c in json.loads(path.read_text()).items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("fused MoE: ignoring unreadable tile table %s (%s)", path, exc)
            return {}
