"""The ``recovery`` extra's dependencies (orbax-checkpoint, zfec), imported where they are used.

Example:
  >>> ocp = require("orbax.checkpoint", "Orbax checkpoints (CheckpointTier)")
"""

from __future__ import annotations

import importlib
import types


def require(module: str, needed_by: str) -> types.ModuleType:
    """The module ``module``, imported now.

    Raises:
      ImportError: ``module`` is not installed; the message names ``needed_by`` and the extra.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{needed_by} needs {module.partition('.')[0]}, which is not installed: "
            "pip install 'sdcguard[recovery]'"
        ) from e
