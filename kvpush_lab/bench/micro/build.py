"""Part a: kvpush's own descriptor build for one large WRITE, the numpy code
(:mod:`kvpush.transfer.coalesce`) against the pure-Python baseline
(:mod:`.baseline`), on the same layout and block ids.

The layout is a GPU one: Llama-3-70B-like (80 layers, 8 KV heads, head dim
128, bf16, 16-token blocks), K and V in separate tensors, so 2 regions per
layer and 32 KiB per block and region; 20,000 blocks per region. Addresses
are made up (nothing is allocated). The WRITE moves 1000 blocks:

* contiguous: source blocks 0..999 to destination 5000..5999, one run, so
  80 x 2 x 1 = 160 descriptors a side;
* fragmented: source and destination each 1000 distinct blocks drawn at
  random from the 20,000 (seeded), so virtually every block is its own run:
  about 80 x 2 x 1000 = 160,000 descriptors a side.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpush.transfer.coalesce import descriptors, runs
from kvpush.transfer.layout import KvLayout
from kvpush_lab.bench.micro import baseline
from kvpush_lab.bench.micro.stats import Spread, time_rounds

NUM_LAYERS = 80
REGIONS_PER_LAYER = 2  # K and V separate, as vLLM's CUDA attention backends
GPU_BLOCK_BYTES = 16 * 8 * 128 * 2  # tokens x KV heads x head dim x bf16
GPU_NUM_BLOCKS = 20_000
NUM_MOVED = 1000
CASES = ("contiguous", "fragmented")


@dataclass(frozen=True)
class Workload:
    """One WRITE's input: two layouts and the block pairs."""

    case: str
    src_layout: KvLayout
    dst_layout: KvLayout
    src: tuple[int, ...]
    dst: tuple[int, ...]

    @property
    def layers(self) -> range:
        return range(self.src_layout.num_layers)


@dataclass(frozen=True)
class BuildTiming:
    case: str
    implementation: str  # "python (before)", "python + tuples for NIXL", "numpy"
    seconds: Spread
    num_runs: int
    num_descs: int  # per side


def layout(
    base: int,
    num_blocks: int = GPU_NUM_BLOCKS,
    block_bytes: int = GPU_BLOCK_BYTES,
    num_layers: int = NUM_LAYERS,
    regions_per_layer: int = REGIONS_PER_LAYER,
) -> KvLayout:
    """Regions back to back from ``base`` (K0, V0, K1, V1, ...)."""
    span = num_blocks * block_bytes
    count = num_layers * regions_per_layer
    return KvLayout(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        block_size=16,
        base_addrs=tuple(base + r * span for r in range(count)),
        regions_per_layer=regions_per_layer,
    )


def block_pairs(
    case: str, num_blocks: int, num_moved: int = NUM_MOVED, seed: int = 0
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Source and destination ids of one WRITE (see the module docstring)."""
    if case == "contiguous":
        offset = min(5000, num_blocks - num_moved)
        return tuple(range(num_moved)), tuple(range(offset, offset + num_moved))
    if case == "fragmented":
        rng = random.Random(seed)
        src = rng.sample(range(num_blocks), num_moved)
        return tuple(src), tuple(rng.sample(range(num_blocks), num_moved))
    raise ValueError(f"case must be one of {CASES}, got {case!r}")


def workload(case: str, src_layout: KvLayout, dst_layout: KvLayout) -> Workload:
    num_blocks = min(src_layout.num_blocks, dst_layout.num_blocks)
    src, dst = block_pairs(case, num_blocks)
    return Workload(case, src_layout, dst_layout, src, dst)


def gpu_workload(case: str) -> Workload:
    return workload(case, layout(0x7F00_0000_0000), layout(0x7E00_0000_0000))


def measure_build(case: str, rounds: int) -> list[BuildTiming]:
    """The three ways of getting from block ids to what NIXL is handed."""
    w = gpu_workload(case)
    num_runs = len(runs(w.src, w.dst))
    num_descs = len(descriptors(runs(w.src, w.dst), *_layouts(w), w.layers)[0])

    def new() -> object:
        return descriptors(runs(w.src, w.dst), w.src_layout, w.dst_layout, w.layers)

    def old() -> tuple[list[baseline.OldDesc], list[baseline.OldDesc]]:
        block_runs = baseline.old_runs(w.src, w.dst)
        return baseline.old_descriptors(block_runs, *_layouts(w), w.layers)

    def old_with_tuples() -> object:
        src, dst = old()
        return baseline.as_tuples(src), baseline.as_tuples(dst)

    timed = (
        ("python (before)", old),
        ("python + tuples for NIXL (before)", old_with_tuples),
        ("numpy (now)", new),
    )
    return [
        BuildTiming(case, name, Spread.of(time_rounds(fn, rounds)), num_runs, num_descs)
        for name, fn in timed
    ]


def _layouts(w: Workload) -> tuple[KvLayout, KvLayout]:
    return w.src_layout, w.dst_layout
