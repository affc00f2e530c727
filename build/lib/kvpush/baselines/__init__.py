"""vLLM's own connectors, fixed just enough to be measured fairly on CPUs."""
