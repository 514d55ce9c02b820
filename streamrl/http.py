"""The one HTTP client module: which httpx API is installed (and, with it, the retry policy)."""

from __future__ import annotations

from typing import Any


def httpx_api() -> Any:
    """The ``httpx`` API: ``httpx`` if installed, else ``httpx2`` (its maintained successor,
    which ``huggingface_hub`` already pulls in; ``pip install streamrl[openai]``)."""
    try:
        import httpx

        return httpx
    except ImportError:
        try:
            import httpx2

            return httpx2
        except ImportError:
            raise ImportError(
                "the openai policy backend needs httpx or httpx2: pip install 'streamrl[openai]'"
            ) from None
