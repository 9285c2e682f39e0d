"""Wire formats: OpenAI request models and the SSE observer."""
