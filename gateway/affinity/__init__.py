"""Prefix-cache affinity: prompt block hashes and where they live (in-process or Redis)."""
