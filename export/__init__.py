"""polyspec.export: profile a chain on the device (T_i, L_i, verdicts), export it as a validated chain folder.

``profile_stage(recipe, tracker=None) -> dict`` and ``export_stage(recipe, tracker=None) -> Path`` are the pipeline's
profile and export stages (:mod:`polyspec.export.stage`; torch loads only when they run). They are resolved lazily
(PEP 562) so that ``python -m polyspec.export.stage`` does not find its own module pre-imported.
Serving lives in :mod:`polyspec.decode.serve`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["export_stage", "profile_stage"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from polyspec.export import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'polyspec.export' has no attribute {name!r}")
