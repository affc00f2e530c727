"""The decode side of KvPushConnector: registrations (scheduler), expected
receives, Hellos and heartbeats (worker)."""
