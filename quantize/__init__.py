"""polyspec.quantize: the int4 intermediate model M2 (W4A16, group size 128) with GPTQModel, calibrated on the
recipe's chat-formatted ShareGPT data, with a quality and speed report.

Public API (lazy: importing this package imports neither torch nor GPTQModel):

* :func:`quantize_stage` (``polyspec quantize RECIPE``) -- :mod:`polyspec.quantize.stage`
* :func:`quantize_model` -- one HF folder to a GPTQ folder, gptq or rtn -- :mod:`polyspec.quantize.gptq`
* :func:`calibration_samples` -- :mod:`polyspec.quantize.calibration`
* :func:`build_report` -- :mod:`polyspec.quantize.report`
"""

from __future__ import annotations

from typing import Any

__all__ = ["quantize_stage", "quantize_model", "calibration_samples", "build_report"]

_WHERE = {
    "quantize_stage": "polyspec.quantize.stage",
    "quantize_model": "polyspec.quantize.gptq",
    "calibration_samples": "polyspec.quantize.calibration",
    "build_report": "polyspec.quantize.report",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'polyspec.quantize' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
