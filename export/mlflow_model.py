"""Log a chain folder as an MLflow pyfunc model (``mlflow.pyfunc.load_model(uri).predict(...)`` decodes with it).

The model is :mod:`polyspec.export.mlflow_chain` logged as code ("models from code": no pickle), with the chain
folder as its artifact ``chain`` and polyspec itself as the wheel artifact ``polyspec_wheel``
(:mod:`polyspec.export.wheel`), which the model's requirements name by its path inside the model: an environment
MLflow builds for it (``--env-manager virtualenv``/``uv``) installs polyspec from there, the other requirements (pinned
to what is installed here) from the user's package index. ``tracking.register_as`` also registers it in the store's
model registry under that name. The signature describes the input (a ``prompt`` or a ``messages`` column, both
optional) and the decoding params; the input example is one short request. mlflow is imported inside the functions.
"""

from __future__ import annotations

import importlib.metadata
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from polyspec.export.wheel import write_wheel

MODEL_NAME = "chain_model"  # the logged model's name in its run
REQUIREMENTS = ("torch", "transformers", "safetensors", "tokenizers", "pydantic", "PyYAML")  # + polyspec's wheel
PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "mode": ""}  # "": manifest's


def requests_from(model_input: Any) -> list[dict[str, Any]]:
    """The model's input -> [{"prompt": str} | {"messages": [...]}, ...]: rows (a list of {"prompt"} / {"messages"}
    objects, or a DataFrame with those columns, which is what MLflow hands over after checking :func:`signature`);
    a bare prompt string or a list of them is taken when ``predict`` is called without a signature."""
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
    if not out:
        raise ValueError("no request: send rows with a 'prompt' or a 'messages' column, e.g. "
                         '{"dataframe_records": [{"prompt": "Hello"}]} (a bare string has no column name)')
    return out


def _present(value: Any) -> bool:
    """A messages value that is there: DataFrame rows without one hold None or NaN; a list (or array) of turns."""
    if value is None or isinstance(value, float):
        return False
    if isinstance(value, (dict, str)):
        raise ValueError(f"'messages' must be a list of {{role, content}} objects, got {value!r}")
    return len(value) > 0


def requirements(wheel: Path) -> list[str]:
    """The model's pip requirements: polyspec's ``wheel`` (by its path inside the model folder, where MLflow copies
    the artifact; pip runs there) and the rest pinned to what is installed here (MLflow would otherwise run the
    model code in a subprocess to guess them)."""
    out = [f"artifacts/{wheel.name}"]
    for pkg in REQUIREMENTS:
        try:
            out.append(f"{pkg}=={importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(pkg)
    return out


def signature() -> Any:
    """One request per row: a ``prompt`` string or a ``messages`` list of {role, content} (each optional, so rows of
    either kind mix; :func:`requests_from` refuses a row with neither), and the decoding params with their defaults.
    ``messages`` is typed Any: MLflow's Array(Object) type refuses the empty cell of a prompt row."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, ParamSchema, ParamSpec, Schema

    inputs = Schema([ColSpec("string", "prompt", required=False), ColSpec(AnyType(), "messages", required=False)])
    kinds = {int: "long", float: "double", str: "string"}
    params = ParamSchema([ParamSpec(k, kinds[type(v)], v) for k, v in PARAMS.items()])
    return ModelSignature(inputs=inputs, params=params)


# MLflow runs the example through the loaded model when it logs it: a few tokens keep that cheap
INPUT_EXAMPLE = ([{"prompt": "Hello"}], {"max_new_tokens": 4})


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
    with tempfile.TemporaryDirectory() as tmp, opened:
        wheel = write_wheel(Path(tmp))
        info = mlflow.pyfunc.log_model(name=MODEL_NAME, python_model=str(code),
                                       artifacts={"chain": str(chain_dir), "polyspec_wheel": str(wheel)},
                                       signature=signature(), input_example=INPUT_EXAMPLE,
                                       pip_requirements=requirements(wheel), registered_model_name=register_as)
    return info.model_uri
