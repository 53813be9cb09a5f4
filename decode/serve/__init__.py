"""polyspec.decode.serve: the chain behind an OpenAI-compatible HTTP API.

- :mod:`polyspec.decode.serve.server`: ``polyspec serve`` (``configure_parser``, ``run``, ``build_app``); light, so
  ``polyspec --help`` does not import fastapi or torch
- :mod:`polyspec.decode.serve.app`: the FastAPI app over a loaded chain
- :mod:`polyspec.decode.serve.api`: the request schema and answer wire format
- :mod:`polyspec.decode.serve.metrics`: the Prometheus counters
- :mod:`polyspec.decode.serve.limits`: the load limits (queue, deadline, prompt length); light, the CLI's defaults
"""
