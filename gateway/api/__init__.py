"""HTTP surface: the proxied OpenAI endpoints, the model list and the operations endpoints."""
