"""The one error type polyspec raises for bad input: the CLI prints its message and exits with its code."""

from __future__ import annotations


class PolyspecError(Exception):
    """Bad input or an unmet precondition, with a message that says what, where and how to fix it.

    ``exit_code`` is what the CLI exits with: 2 for bad input (recipe, arguments, files), 1 for a failed run.
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def missing_extra(package: str, extra: str) -> PolyspecError:
    """The error for an optional heavy package that is not installed."""
    return PolyspecError(
        f"{package} is not installed; it comes with polyspec's [{extra}] extra: pip install 'polyspec[{extra}]'",
        exit_code=2,
    )
