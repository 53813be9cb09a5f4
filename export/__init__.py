"""polyspec.export: profile a chain on the device -> verdict -> package it as a validated chain folder.

Data flow, one module each: :mod:`~polyspec.export.timing` (T_i) and :mod:`~polyspec.export.acceptance` (L_i) feed
:mod:`~polyspec.export.profile` (the n-level grid, final runs, typed :mod:`~polyspec.export.results`), which
:mod:`~polyspec.export.verdict` judges (Theorem 3.2, Lemma 3.1, stability); :mod:`~polyspec.export.report` writes the
profile folder (tables, verdict.md, :mod:`~polyspec.export.plots`); :mod:`~polyspec.export.package` writes the chain
folder (manifest, :mod:`~polyspec.export.onnx_head`); :mod:`~polyspec.export.stage` is the recipe-level glue.

``profile_stage(recipe.profile, ...) -> Profile`` (or ``search_stage(recipe.profile, ...) -> Search``) and
``export_stage(recipe.export, ...) -> Path`` are the pipeline's profile and export stages (torch loads only when they
run), resolved lazily (PEP 562); :mod:`polyspec.pipeline` calls them with a recipe's sections.
Serving lives in :mod:`polyspec.decode.serve`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["export_stage", "profile_stage", "search_stage"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from polyspec.export import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'polyspec.export' has no attribute {name!r}")
