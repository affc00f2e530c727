"""Start, inspect and stop a local vLLM P/D cluster with a router in front."""

from kvpush.launcher.cluster import down, status, up
from kvpush.launcher.config import ClusterConfig, load_config_file

__all__ = ["ClusterConfig", "down", "load_config_file", "status", "up"]
