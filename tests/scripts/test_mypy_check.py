"""scripts/mypy_check.py's counting and comparison, on canned mypy output (mypy itself is not run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import REPO_ROOT


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mypy_check", REPO_ROOT / "scripts" / "mypy_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


mc = _load()
CLEAN = ["gateway.dispatch.ledger", "gateway.dialects.*", "gateway.*.params"]

OUTPUT = """\
gateway/a.py:3: error: Need type annotation for "x"  [var-annotated]
gateway/a.py:9:5: error: Returning Any from function declared to return "int"  [no-any-return]
gateway/a.py:9: note: Right operand is of type "int | None"
gateway/pkg/__init__.py:1: error: Unused "type: ignore" comment  [unused-ignore]
Found 3 errors in 2 files (checked 4 source files)
"""


def test_counts_errors_per_file_not_notes_or_summary() -> None:
    assert mc.count_errors(OUTPUT) == {"gateway/a.py": 2, "gateway/pkg/__init__.py": 1}


def test_growth_fails() -> None:
    result = mc.compare({"gateway/a.py": 1}, {"gateway/a.py": 2}, CLEAN)
    assert result.failed and result.grown == [("gateway/a.py", 1, 2)]
    assert mc.report(result) == ["mypy-check: gateway/a.py: 1 -> 2 errors (the baseline only shrinks)"]


def test_shrink_passes_and_says_how_to_update() -> None:
    result = mc.compare({"gateway/a.py": 3, "gateway/gone.py": 1}, {"gateway/a.py": 1}, CLEAN)
    assert not result.failed
    assert result.shrunk == [("gateway/a.py", 3, 1), ("gateway/gone.py", 1, 0)]
    assert "scripts/mypy-check --update" in mc.report(result)[-1]


def test_unchanged_passes_silently() -> None:
    result = mc.compare({"gateway/a.py": 2}, {"gateway/a.py": 2}, CLEAN)
    assert not result.failed and mc.report(result) == []


def test_new_file_with_errors_fails() -> None:
    result = mc.compare({"gateway/a.py": 2}, {"gateway/a.py": 2, "gateway/b.py": 1}, CLEAN)
    assert result.failed and result.new == [("gateway/b.py", 0, 1)] and not result.grown
    assert "not in mypy-baseline.txt" in mc.report(result)[0]


@pytest.mark.parametrize("path", ["gateway/dispatch/ledger.py", "gateway/dialects/chat.py", "gateway/auth/params.py"])
def test_clean_module_fails_even_when_baselined(path: str) -> None:
    result = mc.compare({path: 5}, {path: 1}, CLEAN)
    assert result.failed and result.unclean == [(path, 5, 1)] and not result.shrunk


def test_clean_patterns_match_modules_not_paths() -> None:
    assert mc.module_name("gateway/dialects/__init__.py") == "gateway.dialects"
    assert not mc.is_clean_module("gateway/dialects/__init__.py", CLEAN)  # `gateway.dialects.*` is its modules
    assert not mc.is_clean_module("gateway/dispatch/ledger_old.py", CLEAN)


def test_baseline_round_trips_and_drops_zero_counts() -> None:
    text = mc.format_baseline({"gateway/b.py": 2, "gateway/a.py": 1, "gateway/c.py": 0})
    assert text.endswith("1 gateway/a.py\n2 gateway/b.py\n")
    assert mc.parse_baseline(text) == {"gateway/a.py": 1, "gateway/b.py": 2}
    with pytest.raises(ValueError, match=r"mypy-baseline\.txt:2"):
        mc.parse_baseline("# header\ntwo gateway/a.py\n")


def test_committed_baseline_parses_and_holds_no_clean_module() -> None:
    baseline = mc.parse_baseline(Path(mc.BASELINE).read_text())
    patterns = mc.clean_patterns()
    assert "gateway.dispatch.ledger" in patterns
    assert [path for path in baseline if mc.is_clean_module(path, patterns)] == []
