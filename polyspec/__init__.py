"""polyspec: one recipe to a validated, served model chain for polybasic speculative decoding.

The core package holds the recipe schema (:mod:`polyspec.config`), the CLI (:mod:`polyspec.cli`), the chain manifest
and the exact theory (:mod:`polyspec.theory`). Stages live in ``polyspec.data``, ``polyspec.train``,
``polyspec.quantize`` and ``polyspec.export``; the engine in ``polyspec.decode`` (serving in
``polyspec.decode.serve``); measuring in ``polyspec.bench``. docs/ARCHITECTURE.md maps them. Nothing heavy is
imported here.
"""

__version__ = "0.1.0"
