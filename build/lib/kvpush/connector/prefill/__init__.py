"""The prefill side of KvPushConnector: push triggers (scheduler), the
side-channel listener, the writer thread and its WRITEs in flight (worker)."""
