"""The gateway's packages import each other downwards only: every package (and top-level module)
sits in one layer, imports only its own layer or lower ones, and the packages form no circle. No
module imports another package's private (`_x`) name. (Module circles: test_import_graph.py.)

A unit is a top-level package or module of gateway/ (`gateway.routing.pools` is `routing`), except
the config schema: gateway/config.py (the composition), config_base.py, config_env.py and every
package's params module (`gateway/<package>/params.py` or `*_params.py`, pydantic only) form the
unit `schema`, which any layer above the base may import and which imports only the base. The
plan file's models (gateway/plans/models.py: pydantic and YAML only, read by the config loader for
`{plan: file}` pools) belong to it too. Imports inside functions and under TYPE_CHECKING count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO_ROOT
from tests.unit.test_import_graph import circles, module_name

PACKAGE = REPO_ROOT / "gateway"

LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"gateway", "errors", "looplag", "protocol", "http_answers", "redis_cluster", "redis_client",
              "redis_gate"}),
    ("schema", {"schema"}),
    ("observability", {"observability", "redact"}),
    ("domain", {"affinity", "auth", "backends", "routing", "parsing", "dialects", "flow"}),
    ("request", {"state", "streaming", "dispatch"}),
    ("serving", {"serving"}),  # uvicorn serving, request heads, shutdown, reload: under the app that uses them
    ("http", {"api", "app"}),
    ("process and tools", {"process", "cli", "sim", "llamacpp_worker", "plans", "drain_command", "config_reference"}),
]
"""Lowest first. A unit may import units of its own layer and of the layers before it."""

SCHEMA_MODULES = {"gateway.config", "gateway.config_base", "gateway.config_env", "gateway.plans.models",
                  "gateway.dialects.names"}  # the API names the schema types `apis` with (imports nothing)

ALLOWED_UP: dict[tuple[str, str], str] = {
    ("gateway.backends.pool_params", "gateway.routing.registry"):
        "a pool's `policy` and `policy_params` are checked with the policy's own parameter model, which "
        "lives with the policy (gateway/routing/policies/) and is found through the registry",
    ("gateway.protocol.sse", "gateway.dialects.names"):
        "SSETap's default API name; goes with the next entry",
    ("gateway.protocol.sse", "gateway.dialects.registry"):
        "SSETap reads its stream's end and error event types from the stream's dialect once per stream; "
        "to go: the relay hands the tap those types (the tap then knows no API)",
    ("gateway.routing.pools", "gateway.dialects.registry"):
        "the pool chain asks a request's dialect which engine path serves it, while the dialects build "
        "routing features (gateway.routing.features); to go: the dialect's engine path on RoutingRequest",
    ("gateway.streaming", "gateway.dispatch.ledger"):
        "a type-only import (TYPE_CHECKING) of the Ledger the relay reports its end facts to; to go: a "
        "facts Protocol in streaming",
}
"""Arrows that run up, each with why it stays: this list only shrinks."""

OTHER_IMPORTERS = ("deploy", "loadtest", "scripts")
"""Code outside gateway/ that must not import gateway's private names either."""


@dataclass(frozen=True)
class Import:
    """`importer` imports gateway module `target`; `name` the name taken from it (None: the module)."""

    importer: str
    target: str
    name: str | None


def is_schema(module: str) -> bool:
    """Whether `module` is part of the config schema (see the module docstring)."""
    last = module.rsplit(".", 1)[-1]
    return module in SCHEMA_MODULES or last == "params" or last.endswith("_params")


def unit(module: str) -> str:
    """The layered unit `module` belongs to: `schema`, or its top-level package or module name."""
    if is_schema(module):
        return "schema"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package(module: str) -> str:
    """The top-level package (or module) of a gateway module; a file outside gateway/: its path's
    first folder (`deploy`)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gateway" and len(parts) > 1 else parts[0]


def gateway_modules() -> dict[str, Path]:
    """Every module of gateway/ by dotted name."""
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, modules: set[str]) -> Iterator[Import]:
    """The gateway imports in one file (`from gateway.x import y` targets gateway.x.y when that is a
    module, else gateway.x with name y)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield Import(name, alias.name, None)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield Import(name, sub, None) if sub in modules else Import(name, node.module, alias.name)


def all_imports(others: tuple[str, ...] = OTHER_IMPORTERS) -> list[Import]:
    """The gateway imports of gateway/ and of the folders `others`."""
    modules = gateway_modules()
    found = [i for name, path in modules.items() for i in imports_of(name, path, set(modules))]
    for folder in others:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            found.extend(imports_of(module_name(path), path, set(modules)))
    return found


def unplaced(units: set[str], layers: list[tuple[str, set[str]]]) -> list[str]:
    """Units in no layer (a new package must be given one)."""
    placed = set().union(*(members for _, members in layers))
    return sorted(units - placed)


def upward(imports: list[Import], layers: list[tuple[str, set[str]]],
           allowed: dict[tuple[str, str], str]) -> list[str]:
    """Every import from a gateway unit into a higher layer, but the allowed ones."""
    level = {u: i for i, (_, members) in enumerate(layers) for u in members}
    found = []
    for imp in imports:
        if not imp.importer.startswith("gateway"):
            continue
        a, b = unit(imp.importer), unit(imp.target)
        if a in level and b in level and level[b] > level[a] and (imp.importer, imp.target) not in allowed:
            found.append(f"{imp.importer} ({layers[level[a]][0]}) -> {imp.target} ({layers[level[b]][0]})")
    return sorted(set(found))


def unit_circles(imports: list[Import], allowed: dict[tuple[str, str], str]) -> list[list[str]]:
    """Circles between units (the allowed arrows left out)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.importer.startswith("gateway") and (imp.importer, imp.target) not in allowed:
            a, b = unit(imp.importer), unit(imp.target)
            if a != b:
                graph.setdefault(a, set()).add(b)
    return circles(graph)


def private_across(imports: list[Import]) -> list[str]:
    """Every private name (`_x`, or a `_x` module) one package takes from another."""
    found = []
    for imp in imports:
        taken = imp.name if imp.name is not None else imp.target.rsplit(".", 1)[-1]
        if taken.startswith("_") and not taken.startswith("__") and package(imp.importer) != package(imp.target):
            found.append(f"{imp.importer} imports {imp.target}: {taken}")
    return sorted(set(found))


def params_packages_with_imports(modules: dict[str, Path]) -> list[str]:
    """Packages that hold a params module and whose __init__ imports something: importing the
    params module would run it (and load the package's code with the schema)."""
    found = []
    for name, path in modules.items():
        if is_schema(name) and "." in name.removeprefix("gateway."):
            init = path.parent / "__init__.py"
            tree = ast.parse(init.read_text(encoding="utf-8"))
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) and not (isinstance(n, ast.ImportFrom)
                   and n.module == "__future__") for n in ast.walk(tree)):
                found.append(module_name(init))
    return sorted(set(found))


def beyond_exports(imports: list[Import], module: str, exported: set[str]) -> list[str]:
    """Names taken from `module` that it does not export (`__all__`): they belong to their owner."""
    return sorted({f"{i.importer}: {i.name}" for i in imports if i.target == module and i.name is not None
                   and i.name not in exported})


SYNTHETIC_LAYERS: list[tuple[str, set[str]]] = [("low", {"errors"}), ("schema", {"schema"}),
                                                 ("mid", {"auth", "api"}), ("top", {"plans"})]


def test_the_checks_find_what_they_look_for() -> None:
    imports = [
        Import("gateway.auth.middleware", "gateway.errors", "GatewayError"),     # down: fine
        Import("gateway.config", "gateway.plans.safety", "check"),              # up: schema -> top
        Import("gateway.plans.safety", "gateway.config_env", "_ENV_REF"),       # private across packages
        Import("gateway.auth.guard", "gateway.auth.keys", "_parse"),            # private within one: fine
        Import("gateway.auth.middleware", "gateway.api.responses", "error_response"),  # same layer ...
        Import("gateway.api.admin", "gateway.auth.middleware", None),           # ... but a circle
        Import("deploy.generate", "gateway.plans.emit", "_command"),            # outside gateway/ too
    ]
    assert upward(imports, SYNTHETIC_LAYERS, {}) == ["gateway.config (schema) -> gateway.plans.safety (top)"]
    assert upward(imports, SYNTHETIC_LAYERS, {("gateway.config", "gateway.plans.safety"): "why"}) == []
    assert unit_circles(imports, {}) == [["api", "auth"], ["plans", "schema"]]  # config <-> plans
    assert private_across(imports) == ["deploy.generate imports gateway.plans.emit: _command",
                                       "gateway.plans.safety imports gateway.config_env: _ENV_REF"]
    assert unplaced({"errors", "schema", "newpkg"}, SYNTHETIC_LAYERS) == ["newpkg"]
    taken = [Import("gateway.app", "gateway.config", "GatewayConfig"),
             Import("tests.x", "gateway.config", "PoolConfig")]
    assert beyond_exports(taken, "gateway.config", {"GatewayConfig"}) == ["tests.x: PoolConfig"]
    assert unit("gateway.routing.params") == unit("gateway.backends.pool_params") == "schema"
    assert unit("gateway.routing.policies.ttft_cost") == "routing"


def test_every_unit_has_a_layer() -> None:
    units = {unit(name) for name in gateway_modules()}
    assert "schema" in units and "routing" in units  # the walk sees the real tree
    assert unplaced(units, LAYERS) == []


def test_no_arrow_runs_up() -> None:
    imports = all_imports()
    assert ("gateway.auth.guard", "gateway.auth.params") in {(i.importer, i.target) for i in imports}  # real imports
    assert upward(imports, LAYERS, ALLOWED_UP) == []


def test_the_allowed_arrows_still_exist() -> None:
    """An allowed arrow that is gone leaves the list (it only shrinks)."""
    arrows = {(i.importer, i.target) for i in all_imports()}
    assert [arrow for arrow in ALLOWED_UP if arrow not in arrows] == []


def test_packages_import_without_circles() -> None:
    assert unit_circles(all_imports(), ALLOWED_UP) == []


def test_no_private_name_crosses_a_package() -> None:
    assert private_across(all_imports()) == []


def test_a_params_module_loads_without_its_package() -> None:
    assert params_packages_with_imports(gateway_modules()) == []


def test_config_names_come_from_their_owners() -> None:
    """gateway/config.py exports the loading API only; a section's model is imported from its params module."""
    import gateway.config

    imports = all_imports((*OTHER_IMPORTERS, "tests"))
    assert beyond_exports(imports, "gateway.config", set(gateway.config.__all__)) == []
