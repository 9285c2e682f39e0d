"""What the documentation states about the repository stays true of it.

- docs/architecture.md, "Modules without a unit test file", lists exactly the gateway modules that
  have no `tests/unit/**/test_<module>.py`, and every test file it cites exists.
- The README's "bring your own engines" config is `config/my-engines.yaml` verbatim, and the file
  is a valid config (the same validation `kimi-gateway check-config` runs, warnings included).
"""

from __future__ import annotations

import re
from pathlib import Path

from gateway.config import load_config
from gateway.plans.safety import production_findings, read_tree

REPO_ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
SECTION = "## Modules without a unit test file"
MY_ENGINES = REPO_ROOT / "config" / "my-engines.yaml"


def modules_without_unit_test() -> set[str]:
    """Repository paths of the gateway modules (no `__init__`/`__main__`) with no same-named unit test file."""
    tested = {path.stem.removeprefix("test_") for path in (REPO_ROOT / "tests" / "unit").rglob("test_*.py")}
    return {str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "gateway").rglob("*.py")
            if path.stem not in {"__init__", "__main__"} and path.stem not in tested}


def listed_section() -> str:
    """The text of architecture.md's section on modules without a unit test file (to the next `## `)."""
    text = ARCHITECTURE.read_text()
    assert SECTION in text, f"docs/architecture.md has no section {SECTION!r}"
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def test_every_module_without_a_unit_test_file_says_why() -> None:
    rows = re.findall(r"^\| `(gateway/[^`]+\.py)` \|", listed_section(), flags=re.MULTILINE)
    listed = set(rows)
    assert len(rows) == len(listed), "a module is listed twice in docs/architecture.md"
    missing = modules_without_unit_test()
    assert not missing - listed, ("no unit test file and no line in docs/architecture.md, "
                                  f"'Modules without a unit test file': {sorted(missing - listed)}")
    assert not listed - missing, ("listed in docs/architecture.md as without a unit test file, but gone or "
                                  f"tested now (delete the line): {sorted(listed - missing)}")


def test_the_tests_cited_for_untested_modules_exist() -> None:
    section = listed_section()
    names = {path.name for path in (REPO_ROOT / "tests").rglob("test_*.py")}
    cited = set(re.findall(r"`((?:tests/)?[\w/]*test_\w+\.py)`", section))
    assert cited
    for name in sorted(cited):
        exists = (REPO_ROOT / name).is_file() if name.startswith("tests/") else Path(name).name in names
        assert exists, f"docs/architecture.md cites {name}, which does not exist"


def test_readme_shows_the_bring_your_own_engines_config_verbatim() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"```yaml\n{MY_ENGINES.read_text()}```" in readme, "README.md: paste config/my-engines.yaml again"


def test_the_bring_your_own_engines_config_is_valid_and_safe_as_shipped() -> None:
    config = load_config(MY_ENGINES, {})
    assert [pool.engine for pool in config.pools] == ["vllm", "sglang"]
    # check-config --strict's findings, in an empty environment: the file holds no ${VAR} to set.
    assert production_findings(read_tree(MY_ENGINES), config, {}) == []
