"""The processes `kimi-gateway` starts around the app: `supervisor` (`processes: N` serving processes
sharing one port, signals passed on) and `demo` (`kimi-gateway demo`: simulated engines and a gateway
in one process). They sit above the app and the serving shell (gateway/serving/). This file imports
nothing."""
