"""The load limits of ``polyspec serve``: how many requests may wait, how long one may take, how long a prompt may be.

A batch-1 server answers one request at a time, so one slow request (a long prompt, a large ``max_tokens``) holds
everyone behind it; these limits bound that. Light on purpose (no fastapi, no torch): the CLI's defaults come from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyspec.errors import PolyspecError


@dataclass(frozen=True)
class ServeLimits:
    """max_queue: requests that may wait for the engine besides the one running; one more gets 429 with Retry-After.
    request_timeout: seconds from a request's arrival to the end of its answer (queue wait included); None = none.
    max_prompt_tokens: prompt tokens a request may send (400 above); None = the model's context only."""

    max_queue: int = 16
    request_timeout: float | None = 120.0
    max_prompt_tokens: int | None = 4096

    def __post_init__(self) -> None:
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise PolyspecError(f"--max-queue must be an integer >= 0, got {self.max_queue!r}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise PolyspecError(f"--request-timeout must be > 0 seconds (0 on the command line = none), got "
                                f"{self.request_timeout!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise PolyspecError(f"--max-prompt-tokens must be >= 1 (0 on the command line = the model's context), "
                                f"got {self.max_prompt_tokens!r}")

    @classmethod
    def from_cli(cls, max_queue: int, request_timeout: float, max_prompt_tokens: int) -> ServeLimits:
        """The command line's values, where 0 means "no limit" for the timeout and the prompt length."""
        return cls(max_queue=max_queue, request_timeout=request_timeout or None,
                   max_prompt_tokens=max_prompt_tokens or None)
