"""Backends: workers, engine differences, the upstream client, health probes."""
