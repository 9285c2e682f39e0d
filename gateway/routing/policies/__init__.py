"""Routing policies, one per module; `gateway.routing.registry` maps their names to classes.

Adding a policy takes one module here plus its registration:

- the module defines the policy's parameter model, a `gateway.config_base.Section` subclass whose
  fields are the pool's `policy_params` (units and bounds in their `Field`s; a policy without
  parameters uses `gateway.routing.policy.NoParams`), and the policy class: `name` (what a pool's
  `policy:` says), `uses_affinity`, `prefill_model` (None but for a cost-aware policy), `Params`
  (the parameter model), `__init__(params)` and `select(request, candidates)`
  (`gateway.routing.policy.RoutingPolicy`);
- registration: add the class to `POLICIES` in gateway/routing/registry.py. The pool config
  (gateway/backends/pool_params.py) checks `policy` and `policy_params` against
  `registry.POLICY_PARAMS`, so nothing else changes.
"""
