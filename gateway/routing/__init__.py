"""Routing: request features, token estimates, pool choice, policies."""
