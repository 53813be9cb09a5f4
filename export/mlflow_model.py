"""Log a chain folder as an MLflow pyfunc model (``mlflow.pyfunc.load_model(uri).predict(...)`` decodes with it).

The model is :mod:`polyspec.export.mlflow_chain` logged as code ("models from code": no pickle), with the chain
folder as its artifact ``chain``; loading it needs polyspec installed (its version is pinned in the model's
requirements). ``tracking.register_as`` also registers it in the store's model registry under that name.
mlflow is imported inside the functions.
"""

from __future__ import annotations

import importlib.metadata
from contextlib import nullcontext
from pathlib import Path
from typing import Any

MODEL_NAME = "chain_model"  # the logged model's name in its run
REQUIREMENTS = ("polyspec", "torch", "transformers", "safetensors", "tokenizers")
PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "mode": ""}  # "": manifest's


def requests_from(model_input: Any) -> list[dict[str, Any]]:
    """Whatever ``predict`` was given -> [{"prompt": str} | {"messages": [...]}, ...]: a prompt string, a list of
    prompts, one {"prompt"} / {"messages"} object or a list of them, or a DataFrame with those columns."""
    if hasattr(model_input, "to_dict"):  # a pandas DataFrame: one request per row
        model_input = model_input.to_dict(orient="records")
    if isinstance(model_input, (str, dict)):
        model_input = [model_input]
    out = []
    for item in model_input:
        if isinstance(item, str):
            out.append({"prompt": item})
            continue
        messages = item.get("messages") if isinstance(item, dict) else None
        prompt = item.get("prompt") if isinstance(item, dict) else None
        if _present(messages):
            out.append({"messages": [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]})
        elif isinstance(prompt, str):
            out.append({"prompt": prompt})
        else:
            raise ValueError(f"each request needs a 'prompt' string or a 'messages' list, got {item!r}")
    return out


def _present(value: Any) -> bool:
    """A messages value that is there: DataFrame rows without one hold None or NaN."""
    return value is not None and not isinstance(value, float) and len(value) > 0


def requirements() -> list[str]:
    """The model's pip requirements, pinned to what is installed here (MLflow would otherwise run the model code
    in a subprocess to guess them)."""
    out = []
    for pkg in REQUIREMENTS:
        try:
            out.append(f"{pkg}=={importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(pkg)
    return out


def signature() -> Any:
    """The decoding params with their defaults. No input schema: MLflow would turn a mixed list of prompt and
    messages requests into a DataFrame and refuse the missing cells; :func:`requests_from` checks the input."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ParamSchema, ParamSpec

    kinds = {int: "long", float: "double", str: "string"}
    return ModelSignature(inputs=None, params=ParamSchema([ParamSpec(k, kinds[type(v)], v) for k, v in PARAMS.items()]))


def log_chain_model(tracker: Any, chain_dir: Path, register_as: str | None = None) -> str | None:
    """Log ``chain_dir`` as a pyfunc model in the tracker's run (registered as ``register_as`` when given); returns
    the model URI, or None when the tracker is off."""
    if tracker is None or not getattr(tracker, "enabled", False):
        return None
    import mlflow

    code = Path(__file__).with_name("mlflow_chain.py")
    active = mlflow.active_run()
    opened = (nullcontext() if active is not None and active.info.run_id == tracker.run_id
              else mlflow.start_run(run_id=tracker.run_id, nested=active is not None))
    with opened:
        info = mlflow.pyfunc.log_model(name=MODEL_NAME, python_model=str(code), artifacts={"chain": str(chain_dir)},
                                       signature=signature(), pip_requirements=requirements(),
                                       registered_model_name=register_as)
    return info.model_uri
