"""CustomResourceDefinition schemas as strict JSON Schemas, for check-jsonschema.

A CRD's `spec.versions[].schema.openAPIV3Schema` is OpenAPI v3 with Kubernetes extensions. The API
server prunes unknown fields and reads the extensions; plain JSON Schema does neither. The
conversion makes the schema mean what the API server enforces, and fail what it would drop:

- every object with `properties` (and no `x-kubernetes-preserve-unknown-fields`, no
  `additionalProperties` of its own) gets `additionalProperties: false`: a misspelt field fails
  here, as `kubectl apply --validate=strict` fails it;
- `x-kubernetes-int-or-string` becomes `type: [integer, string]`; `nullable: true` adds `null`;
- `apiVersion` and `kind` are pinned to the CRD's group/version and kind, and required;
- a Go (RE2) `(?i)` flag, which ECMA regular expressions (check-jsonschema's) lack, becomes
  letter classes (`(?i)warn` -> `[wW][aA][rR][nN]`);
- descriptions and CEL rules (`x-kubernetes-validations`, not expressible here) are dropped.

    python -m tests.deploy.crd_schema CRD.yaml OUT.json   # one CRD file -> the schema of its served version
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

SCHEMAS = Path(__file__).parent / "crd-schemas"
DROPPED = ("description", "x-kubernetes-validations")


def _ecma(pattern: str) -> str:
    """A Go regular expression's case-insensitive flag spelt as letter classes (patterns without
    character classes or escapes after the flag; others are returned unchanged)."""
    head, flag, tail = pattern.partition("(?i)")
    if not flag or "[" in tail or "\\" in tail:
        return pattern
    return head + "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in tail)


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items() if k not in DROPPED}
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _ecma(out["pattern"])
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["type"] = ["integer", "string"]
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def json_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """The strict JSON Schema (draft 7) of `crd`'s `version` (default: its storage version).

    Raises ValueError if the CRD has no such version or the version has no schema."""
    spec = crd["spec"]
    versions = {v["name"]: v for v in spec["versions"]}
    if version is None:
        version = next(v["name"] for v in spec["versions"] if v.get("storage"))
    if version not in versions or "schema" not in versions[version]:
        raise ValueError(f"{crd['metadata']['name']}: no schema for version {version!r}")
    schema = _strict(versions[version]["schema"]["openAPIV3Schema"])
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"const": f"{spec['group']}/{version}"}
    props["kind"] = {"const": spec["names"]["kind"]}
    props["metadata"] = {"type": "object"}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return {"$schema": "http://json-schema.org/draft-07/schema#",
            "title": f"{spec['names']['kind']} {spec['group']}/{version}", **schema}


def schema_path(api_version: str, kind: str) -> Path:
    """Where the vendored schema of `kind` at `api_version` (group/version) lives."""
    group, version = api_version.split("/")
    return SCHEMAS / f"{kind.lower()}.{group}.{version}.json"


def main(argv: list[str]) -> int:
    """Convert the CRD file argv[0] (its storage version) into the JSON Schema file argv[1]."""
    crd = yaml.safe_load(Path(argv[0]).read_text(encoding="utf-8"))
    Path(argv[1]).write_text(json.dumps(json_schema(crd), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
