"""Routing policies, one per module; `gateway.routing.registry` maps their names to classes."""
