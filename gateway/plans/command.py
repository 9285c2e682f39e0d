"""`kimi-gateway plan FILE [--json] [--precision P] [--emit DIR]`: capacity report and launch scripts.

FILE is a plan (`config/plans/plan-a.yaml`) or a gateway config whose pools name plans
(`config/k3-production.yaml`); then every plan-derived pool is reported, in pool order.
Exit status 0 when every plan fits, 1 when one is refused (its numbers are in the report), 2 for a
file that cannot be read or a plan the model cannot serve (context above its maximum, parallel sizes
that do not divide, a precision its checkpoint does not hold), and for `--emit` with a `--precision`
the checkpoint does not hold (a what-if report is fine; a launch script for it would lie).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from gateway.plans.capacity import format_assumption, plan_capacity, render_report
from gateway.plans.emit import emit_scripts
from gateway.plans.models import LoadedPlan, PlanError, Precision, is_plan_data, load_plan, plan_refs


def plans_of(path: str | Path) -> list[LoadedPlan]:
    """The plans a file describes: itself if it is a plan, else the plans its `pools:` name.

    Raises PlanError for an unreadable file, a bad plan, or a config that names no plan.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise PlanError(f"{path}: the top level must be a mapping")
    if is_plan_data(data):
        return [load_plan(path)]
    refs = plan_refs(data, path.parent)
    if not refs:
        raise PlanError(f"{path}: neither a plan (no `hardware:`) nor a config whose pools name plans")
    return [load_plan(ref) for ref in refs]


def run_plan(file: str, as_json: bool = False, precision: Precision | None = None, emit: str | None = None) -> int:
    """Print the capacity report of `file`'s plans; with `emit`, write their launch scripts. Returns the exit status."""
    try:
        plans = plans_of(file)
    except PlanError as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return 2
    reports = [plan_capacity(loaded, precision) for loaded in plans]
    if as_json:
        print(json.dumps([r.as_json() for r in reports], indent=2))
    else:
        print("\n\n".join(render_report(r, assumptions=False) for r in reports))
        print("\nassumptions (config/models/kimi-k3.yaml; not published figures):")
        for a in reports[0].assumptions:
            print(f"  {format_assumption(a)}")
    refused = [r for r in reports if not r.fits]
    for r in refused:
        print(f"plan {r.plan} refused: {r.refusal}", file=sys.stderr)
    if refused:
        return 1
    if emit is not None:
        other = [(loaded, loaded.checkpoint()) for loaded in plans]
        other = [(loaded, c) for loaded, c in other if precision is not None and precision != c.precision]
        for loaded, checkpoint in other:
            print(f"plan error: --precision {precision} with --emit: plan {loaded.plan.name} mounts {checkpoint.path}, "
                  f"which holds {checkpoint.precision} weights (--dtype does not dequantize); point "
                  f"engine.model_path at a {precision} checkpoint. Nothing written", file=sys.stderr)
        if other:
            return 2
        try:
            written = emit_scripts(plans, emit)
        except OSError as exc:
            print(f"plan error: cannot write the launch scripts to {emit}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    return 0
