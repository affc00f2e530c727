"""What the instances run on, and what that changes in their commands.

vLLM's CPU build and its CUDA build take different settings. On CPU the
launcher runs eagerly (``--enforce-eager``), bounds the context
(``--max-model-len 4096``) and the KV cache (``VLLM_CPU_KVCACHE_SPACE``),
binds each rank to a core (``VLLM_CPU_OMP_THREADS_BIND``), defaults to
float32 (outputs compared across modes agree to ~1e-6), keeps KV in host
memory (``kv_buffer_device: "cpu"``) and loads vLLM's NIXL connectors with
two CPU-host fixes (:mod:`kvpush.baselines.fair_nixl`). On CUDA none of that
applies: CUDA graphs, the model's own context length and dtype, KV in GPU
memory (``"cuda"``) for kvpush and the baselines alike, and vLLM's own,
unpatched connectors for the baselines.

Detection (:func:`detect_platform`) is cheap: package metadata and two
paths, no import of torch or vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from importlib import metadata
from pathlib import Path


class Platform(enum.StrEnum):
    """The device an instance's model runs on."""

    CPU = "cpu"
    CUDA = "cuda"

    @property
    def default_dtype(self) -> str:
        """``--dtype`` when none is given: float32 on CPU (exact comparisons
        of outputs), the model's own (``auto``) on CUDA."""
        return "float32" if self is Platform.CPU else "auto"

    @property
    def default_max_model_len(self) -> int | None:
        """``--max-model-len`` when none is given (None: the model's)."""
        return 4096 if self is Platform.CPU else None

    @property
    def default_kv_cache_space_gb(self) -> int | None:
        """``VLLM_CPU_KVCACHE_SPACE`` when none is given (None: not set)."""
        return 1 if self is Platform.CPU else None

    @property
    def kv_buffer_device(self) -> str:
        """Where the connectors keep and send KV: the device the cache is on."""
        return self.value


AUTO = "auto"
PLATFORM_CHOICES = (AUTO, *(p.value for p in Platform))


def resolve_platform(value: str | Platform) -> Platform:
    """``value`` as a Platform, ``auto`` as :func:`detect_platform` finds it;
    ValueError, naming the choices, for anything else."""
    if value == AUTO:
        return detect_platform()
    try:
        return Platform(value)
    except ValueError:
        raise ValueError(
            f"platform must be one of {', '.join(PLATFORM_CHOICES)}, not {value!r}"
        ) from None


def as_platform(value: object) -> Platform:
    """A config's ``platform`` value as a Platform: ``cpu`` or ``cuda``
    (``auto`` must be resolved first, by :func:`resolve_platform`)."""
    if not isinstance(value, str) or value not in tuple(Platform):
        raise ValueError(
            f"platform must be cpu or cuda, not {value!r} (auto is resolved by "
            "the command line: kvpush.launcher.platform.resolve_platform)"
        )
    return Platform(value)


def check_kv_memory(
    platform: Platform,
    kv_cache_space_gb: int | None,
    gpu_memory_utilization: float | None,
) -> None:
    """ValueError unless the KV cache's size is set the platform's way:
    ``VLLM_CPU_KVCACHE_SPACE`` on CPU, vLLM's GPU memory fraction on CUDA,
    each refused on the other platform."""
    if platform == Platform.CPU:
        if kv_cache_space_gb is not None and kv_cache_space_gb < 1:
            raise ValueError("kv_cache_space_gb must be at least 1")
        if gpu_memory_utilization is not None:
            raise ValueError(
                "gpu_memory_utilization is for --platform cuda; on CPU size the "
                "KV cache with --kv-cache-space-gb"
            )
        return
    if kv_cache_space_gb is not None:
        raise ValueError(
            "kv_cache_space_gb sizes the CPU backend's KV cache "
            "(VLLM_CPU_KVCACHE_SPACE); on CUDA give --gpu-memory-utilization"
        )
    fraction = gpu_memory_utilization
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {fraction!r}")


def detect_platform() -> Platform:
    """CPU where vLLM's CPU build is installed, CUDA where its CUDA build is;
    with no vLLM here (printing a command for another host), CUDA when an
    NVIDIA GPU is visible, else CPU."""
    return platform_of(vllm_build(), has_nvidia_gpu())


def platform_of(build: str | None, nvidia_gpu: bool) -> Platform:
    """The platform for vLLM's ``build`` (``cpu``, ``cuda`` or None: not
    installed) on a host with or without a visible NVIDIA GPU."""
    if build is not None:
        return Platform(build)
    return Platform.CUDA if nvidia_gpu else Platform.CPU


def vllm_build(version: Callable[[str], str] = metadata.version) -> str | None:
    """Which vLLM build is installed: ``cpu`` (the ``vllm-cpu``
    distribution, or a ``vllm`` whose version says ``cpu``, as vLLM itself
    decides), ``cuda`` (any other ``vllm``) or None (none)."""
    try:
        return "cpu" if "cpu" in version("vllm") else "cuda"
    except metadata.PackageNotFoundError:
        pass
    try:
        version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None
    return "cpu"


def has_nvidia_gpu(root: Path = Path("/")) -> bool:
    """Whether the NVIDIA driver shows a GPU to this host (or container)."""
    gpus = root / "proc/driver/nvidia/gpus"
    return any((root / "dev").glob("nvidia[0-9]*")) or (
        gpus.is_dir() and any(gpus.iterdir())
    )
