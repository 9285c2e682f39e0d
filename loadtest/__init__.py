"""Load tests of kimi-gateway: trace replay against simulated workers (`python -m loadtest.replay`)."""
