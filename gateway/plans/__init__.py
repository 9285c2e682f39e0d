"""K3 deployment plans: plan files and the model card (models.py), the capacity planner (capacity.py),
engine launch scripts (emit.py) and production-safety checks of a gateway config (safety.py).

Kept off the request path: the gateway imports it only while loading a config that names a plan.
"""
