"""Convert one version of a CustomResourceDefinition to a strict JSON Schema for check-jsonschema.

    python tests/deploy/crd-schemas/openapi2jsonschema.py CRD.yaml VERSION > OUT.json

The CRD's `openAPIV3Schema` is already JSON Schema apart from the `x-kubernetes-*` extensions
(check-jsonschema ignores those). Made strict as the API server's structural pruning would be: every
object that lists `properties` and neither `additionalProperties` nor
`x-kubernetes-preserve-unknown-fields` rejects other keys, so a misspelt field fails rather than
being dropped at apply time; `apiVersion` and `kind` must be the CRD's. Descriptions are left out.
Go's case-insensitive flag `(?i)`, which JSON Schema's (ECMA 262) patterns lack, becomes `[aA]` classes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml


def ecma_pattern(pattern: str) -> str:
    """`pattern` without Go's `(?i)` flag: each letter matched in either case. ValueError for a flagged
    pattern with escapes or character classes (not needed by the vendored CRDs, so not translated)."""
    if "(?i)" not in pattern:
        return pattern
    rest = pattern.replace("(?i)", "")
    if "\\" in rest or "[" in rest:
        raise ValueError(f"cannot translate the case-insensitive pattern {pattern!r}")
    return re.sub(r"[A-Za-z]", lambda m: f"[{m.group().lower()}{m.group().upper()}]", rest)


def strict(node: Any) -> Any:
    """`node` (a schema or part of one) without descriptions, objects closed to unlisted keys."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items() if key != "description"}
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ecma_pattern(out["pattern"])
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def convert(crd: dict[str, Any], version: str) -> dict[str, Any]:
    """The JSON Schema of `crd`'s `version`; KeyError/ValueError when the CRD has no such version."""
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict(served["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"enum": [f"{crd['spec']['group']}/{version}"]}
    schema["properties"]["kind"] = {"enum": [crd["spec"]["names"]["kind"]]}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return {"$schema": "http://json-schema.org/draft-07/schema#", **schema}


def main(argv: list[str]) -> int:
    crd = yaml.safe_load(Path(argv[1]).read_text())
    json.dump(convert(crd, argv[2]), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
