"""The load limits of ``polyspec serve``: how many requests may wait, how long one may take, how long a prompt may be.

A batch-1 server answers one request at a time, so one slow request (a long prompt, a large ``max_tokens``) holds
everyone behind it; these limits bound that. Light on purpose (no fastapi, no torch): the CLI's defaults come from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polyspec.errors import PolyspecError


@dataclass(frozen=True)
class ServeLimits:
    """max_queue: requests that may wait for the engine besides the one running; one more gets 429 with Retry-After.
    request_timeout: seconds from a request's arrival to the end of its answer (queue wait included); None = none.
    max_prompt_tokens: prompt tokens a request may send (400 above); None = the model's context only.
    read_timeout: seconds a client has to send a request's headers (from its connection, or the end of the previous
    answer) and then its body; a slower one is answered 408 and dropped.
    max_connections: connections open at once; one more is answered 503 and closed (each slow client holds one until
    the read timeout drops it)."""

    max_queue: int = 16
    request_timeout: float | None = 120.0
    max_prompt_tokens: int | None = 4096
    read_timeout: float = 10.0
    max_connections: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise PolyspecError(f"--max-queue must be an integer >= 0, got {self.max_queue!r}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise PolyspecError(f"--request-timeout must be > 0 seconds (0 on the command line = none), got "
                                f"{self.request_timeout!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise PolyspecError(f"--max-prompt-tokens must be >= 1 (0 on the command line = the model's context), "
                                f"got {self.max_prompt_tokens!r}")
        if not (isinstance(self.read_timeout, (int, float)) and math.isfinite(self.read_timeout)
                and self.read_timeout > 0):
            raise PolyspecError(f"--read-timeout must be a number of seconds > 0, got {self.read_timeout!r}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise PolyspecError(f"--max-connections must be an integer >= 1, got {self.max_connections!r}")

    @classmethod
    def from_cli(cls, max_queue: int, request_timeout: float, max_prompt_tokens: int, read_timeout: float,
                 max_connections: int) -> ServeLimits:
        """The command line's values, where 0 means "no limit" for the timeout and the prompt length."""
        return cls(max_queue=max_queue, request_timeout=request_timeout or None,
                   max_prompt_tokens=max_prompt_tokens or None, read_timeout=read_timeout,
                   max_connections=max_connections)
