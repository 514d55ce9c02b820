"""Model directories on this machine. streamrl never downloads from a model hub at run time, so
a model is a directory saved with ``save_pretrained``; saying so beats transformers' message
for a missing path ("Repo id must be in the form 'repo_name'…")."""

from __future__ import annotations

from pathlib import Path


class ModelNotFound(FileNotFoundError):
    pass


def require_model_dir(path: str, field: str) -> Path:
    """The directory, or ModelNotFound naming the config field and what is missing."""
    if not path:
        raise ModelNotFound(f"{field} is empty: give a model directory (save_pretrained output)")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelNotFound(
            f"{field} = {path!r}: no such directory (resolved {p.resolve()}); streamrl loads "
            "models from local directories saved with save_pretrained and never downloads"
        )
    if not (p / "config.json").is_file():
        raise ModelNotFound(
            f"{field} = {path!r} is a directory without config.json: not a saved transformers model"
        )
    return p
