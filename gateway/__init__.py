"""kimi-gateway: an OpenAI-compatible gateway and multi-pool router for Kimi K3."""
