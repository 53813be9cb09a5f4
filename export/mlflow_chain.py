"""The chain as an MLflow pyfunc model (MLflow "models from code": MLflow runs this file to build the model).

Only MLflow imports this file: when :func:`polyspec.export.mlflow_model.log_chain_model` logs it, and when
``mlflow.pyfunc.load_model(uri)`` loads the model. The chain folder travels as the model's artifact ``chain``; no
pickle is written or read. ``predict`` decodes with the chain (its manifest's mode unless ``params.mode`` says
otherwise):

* input: rows, one per request, each with a ``prompt`` string or a ``messages`` list of {role, content}: a list of
  such objects or a pandas DataFrame (over HTTP: ``{"dataframe_records": [...]}``), as the model's signature says;
* params: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``mode`` (ar | dual | chain);
* output: one dict per request: ``text``, ``new_tokens``, ``tokens_per_second``, ``mode``, ``mean_accepted``
  ({level: tokens emitted per forward, the paper's L_i}) and ``beta``.
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel

from polyspec.export.mlflow_model import PARAMS, requests_from


class ChainModel(PythonModel):
    """``predict`` decodes with the polyspec chain in the model's ``chain`` artifact."""

    def load_context(self, context):
        from polyspec.decode.generate import load_chain

        device = (context.model_config or {}).get("device", "auto")
        self.chain = load_chain(context.artifacts["chain"], device=device)

    def predict(self, context, model_input, params=None):  # no type hints: MLflow would derive a schema from them
        from polyspec.decode.generate import generate_text

        p = {**PARAMS, **(params or {})}
        answers = []
        for req in requests_from(model_input):
            ans = generate_text(self.chain, req.get("prompt"), messages=req.get("messages"),
                                mode=p["mode"] or None, max_new_tokens=int(p["max_new_tokens"]),
                                temperature=float(p["temperature"]), top_p=float(p["top_p"]), top_k=int(p["top_k"]),
                                seed=int(p["seed"]))
            s = ans["stats"]
            answers.append({"text": ans["text"], "new_tokens": s["new_tokens"],
                            "tokens_per_second": float(s["tokens_per_second"]), "mode": s["mode"],
                            "mean_accepted": {lv["name"]: float(lv["mean_accepted"]) for lv in s["levels"]},
                            "beta": s["beta"]})
        return answers


mlflow.models.set_model(ChainModel())
