"""The repository tracks no local environment: a worktree's `.venv` symlink once slipped into a
merge and, checked out, replaced the real virtualenv (an ignored path git may overwrite)."""

from __future__ import annotations

import subprocess

from tests.support import REPO_ROOT


def test_no_virtualenv_or_cache_is_tracked() -> None:
    tracked = subprocess.run(["git", "ls-files", "--", ".venv", ".venv/*", "site", ".agents"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked == []
