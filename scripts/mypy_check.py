"""mypy over gateway/ against a baseline that only shrinks (run as `scripts/mypy-check`).

Every module is checked strictly (`[tool.mypy]` in pyproject.toml). The errors that predate the check
are counted per file in `mypy-baseline.txt`; the check fails when a file's count grows, when a file
that is not in the baseline has errors, or when a module matched by `[tool.kimi-gateway.mypy-check]
clean` has any. When counts shrank it passes and says how to record that: `scripts/mypy-check
--update` rewrites the baseline from the current counts, refusing any growth unless `--allow-growth`
(e.g. after modules moved: their errors appear under new paths) and never baselining a `clean` module.

Exit status: 0 pass, 1 check failed (or `--update` refused), 2 mypy itself failed (config error, crash).
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BASELINE = REPO_ROOT / "mypy-baseline.txt"
HEADER = """\
# mypy errors per file that predate the strict check: scripts/mypy-check fails when a count grows or a
# file not listed here has errors. Fix errors, then `scripts/mypy-check --update` (it only shrinks).
# Format: <error count> <path>
"""
ERROR_LINE = re.compile(r"^(?P<path>[^:\s][^:]*\.pyi?):\d+(?::\d+)?: error: ")
UPDATE_HINT = "scripts/mypy-check --update"


def count_errors(mypy_output: str) -> dict[str, int]:
    """Errors per file path (as mypy prints it, relative to the repository) in mypy's text output;
    notes and the summary line are not counted."""
    counts: Counter[str] = Counter()
    for line in mypy_output.splitlines():
        if match := ERROR_LINE.match(line):
            counts[match["path"]] += 1
    return dict(counts)


def parse_baseline(text: str) -> dict[str, int]:
    """`<count> <path>` lines (comments and blank lines skipped) as {path: count}; ValueError on a
    malformed line."""
    baseline: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        count, _, path = line.partition(" ")
        if not count.isdigit() or not path.strip():
            raise ValueError(f"mypy-baseline.txt:{number}: expected '<count> <path>', got {raw!r}")
        baseline[path.strip()] = int(count)
    return baseline


def format_baseline(counts: dict[str, int]) -> str:
    """The baseline file's text for `counts` (files without errors left out), sorted by path."""
    return HEADER + "".join(f"{count} {path}\n" for path, count in sorted(counts.items()) if count > 0)


def module_name(path: str) -> str:
    """`gateway/dispatch/ledger.py` -> `gateway.dispatch.ledger`; a package's `__init__.py` -> the package."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_clean_module(path: str, patterns: list[str]) -> bool:
    """Whether the module at `path` matches one of the `clean` fnmatch patterns."""
    name = module_name(path)
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@dataclass
class Comparison:
    """Current counts against the baseline. Each change is (path, baseline count, current count)."""

    grown: list[tuple[str, int, int]] = field(default_factory=list)
    new: list[tuple[str, int, int]] = field(default_factory=list)
    shrunk: list[tuple[str, int, int]] = field(default_factory=list)
    unclean: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Whether the check fails: a count grew, a new file has errors or a `clean` module has any."""
        return bool(self.grown or self.new or self.unclean)


def compare(baseline: dict[str, int], current: dict[str, int], clean: list[str]) -> Comparison:
    """Sort every file whose count differs from the baseline into grown / new / shrunk, and every
    `clean` module with errors into unclean (whatever the baseline says)."""
    result = Comparison()
    for path in sorted(set(baseline) | set(current)):
        old, now = baseline.get(path, 0), current.get(path, 0)
        if now and is_clean_module(path, clean):
            result.unclean.append((path, old, now))
        elif now > old:
            (result.grown if path in baseline else result.new).append((path, old, now))
        elif now < old:
            result.shrunk.append((path, old, now))
    return result


def report(result: Comparison) -> list[str]:
    """Human-readable lines for a comparison: what failed and why, what shrank and how to record it."""
    lines = [f"mypy-check: {path} must have no mypy errors (a `clean` module in pyproject.toml), has {now}"
             for path, _, now in result.unclean]
    lines += [f"mypy-check: {path}: {old} -> {now} errors (the baseline only shrinks)"
              for path, old, now in result.grown]
    lines += [f"mypy-check: {path}: 0 -> {now} errors (not in mypy-baseline.txt: new code is checked strictly)"
              for path, _, now in result.new]
    if result.shrunk:
        lines += [f"mypy-check: {path}: {old} -> {now} errors, fewer than the baseline"
                  for path, old, now in result.shrunk]
        lines.append(f"mypy-check: counts shrank: run `{UPDATE_HINT}` and commit mypy-baseline.txt")
    return lines


def lines_for(output: str, changes: list[tuple[str, int, int]]) -> str:
    """mypy's output lines (errors and notes) about the files in `changes`."""
    paths = {path for path, _, _ in changes}
    return "".join(line + "\n" for line in output.splitlines() if line.split(":", 1)[0] in paths)


def clean_patterns(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """`[tool.kimi-gateway.mypy-check] clean` of pyproject.toml (empty when unset)."""
    config = tomllib.loads(pyproject.read_text())
    return list(config.get("tool", {}).get("kimi-gateway", {}).get("mypy-check", {}).get("clean", []))


def run_mypy() -> tuple[int, str]:
    """Run mypy (this interpreter's) with pyproject.toml's config from the repository root: its exit
    status and output."""
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-pretty", "--no-error-summary"], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def main(argv: list[str] | None = None) -> int:
    """The command line: check (default) or `--update [--allow-growth]`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="scripts/mypy-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite mypy-baseline.txt from the current counts")
    parser.add_argument("--allow-growth", action="store_true",
                        help="with --update: accept counts that grew or new files (e.g. after modules moved)")
    args = parser.parse_args(argv)
    status, output = run_mypy()
    current = count_errors(output)
    if status not in (0, 1) or (status == 1 and not current):
        print(output, end="", file=sys.stderr)
        print(f"mypy-check: mypy failed (exit status {status})", file=sys.stderr)
        return 2
    baseline = parse_baseline(BASELINE.read_text()) if BASELINE.exists() else {}
    result = compare(baseline, current, clean_patterns())
    if args.update:
        refused = result.unclean or ((result.grown or result.new) and not args.allow_growth)
        if refused:
            print(lines_for(output, result.grown + result.new + result.unclean), end="", file=sys.stderr)
            for line in report(Comparison(grown=result.grown, new=result.new, unclean=result.unclean)):
                print(line, file=sys.stderr)
            total_old, total_now = sum(baseline.values()), sum(current.values())
            hint = " (`--allow-growth` accepts it; `clean` modules are never baselined)"
            if not BASELINE.exists():
                hint = " (there is none yet: `--update --allow-growth` creates it)"
            if not result.unclean and total_now <= total_old:
                hint = f" (the total did not grow, {total_old} -> {total_now}: if modules moved, add --allow-growth)"
            print(f"mypy-check: refusing to grow mypy-baseline.txt{hint}", file=sys.stderr)
            return 1
        BASELINE.write_text(format_baseline(current))
        print(f"mypy-check: mypy-baseline.txt: {sum(current.values())} errors in {len(current)} files "
              f"(was {sum(baseline.values())} in {len(baseline)})")
        return 0
    if result.failed:
        print(lines_for(output, result.grown + result.new + result.unclean), end="", file=sys.stderr)
    for line in report(result):
        print(line, file=sys.stderr if result.failed else sys.stdout)
    if not result.failed:
        print(f"mypy-check: ok, {sum(current.values())} baselined errors in {len(current)} files")
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
