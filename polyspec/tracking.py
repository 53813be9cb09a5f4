"""MLflow tracking: one parent run per ``polyspec run``, one nested run per stage.

``start_run(recipe, stage)`` is a context manager yielding a :class:`Tracker`. Every run it starts records the
resolved recipe (artifact ``recipe.yaml`` and flattened ``section.key`` params), the command line, the git SHA, the
package versions and the hardware (tags, and artifact ``stamp.json``). It ends FINISHED on success and FAILED when
the block raises (the exception propagates). With ``tracking.enabled: false`` the Tracker does nothing.

MLflow keeps one global "active run" stack. A run started here nests under whatever run is active, whether ours
(the parent ``run``) or the user's (a notebook), and never ends a run it did not start. The global tracking URI is
set only while an outermost polyspec run is open and is put back afterwards. mlflow is imported inside functions.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from polyspec.config import Recipe, recipe_to_yaml
from polyspec.errors import PolyspecError

log = logging.getLogger(__name__)

MAX_VALUE_CHARS = 6000  # MLflow's limit for a param value (tags allow 8000)


def tracking_uri(recipe: Recipe) -> str:
    """The tracking URI: ``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<workdir>/mlflow.db``."""
    if recipe.tracking.uri:
        return recipe.tracking.uri
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    return "sqlite:///" + (Path(recipe.workdir).resolve() / "mlflow.db").as_posix()


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (absolute), or None for any other kind of store."""
    if not uri.startswith("sqlite:///"):
        return None
    rest = unquote(uri[len("sqlite:///") :].split("?", 1)[0])  # "sqlite:////abs/x.db" -> "/abs/x.db"
    if not rest or rest == ":memory:":
        return None
    return Path(rest).resolve()


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps artifacts: ``<folder of the sqlite file>/mlartifacts`` for a sqlite store
    (``<workdir>/mlartifacts`` by default; a run's files land in ``mlartifacts/<run_id>/artifacts``); None (the
    server's default) for other stores."""
    db = sqlite_path(uri)
    return (db.parent / "mlartifacts").as_uri() if db is not None else None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _text(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """A param/tag value as text: JSON for lists and dicts, str otherwise, cut to ``limit`` characters."""
    s = json.dumps(value) if isinstance(value, (list, dict, tuple)) else str(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


class Tracker:
    """Logging into one MLflow run (``run_id``); with ``run_id`` None every method does nothing.

    Calls go to that run explicitly through an ``MlflowClient``, not to MLflow's global active run.
    """

    def __init__(
        self, run_id: str | None = None, client: Any = None, experiment_id: str | None = None, uri: str | None = None
    ):
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.uri = uri  # the store holding the run (e.g. for Lightning's MLFlowLogger(tracking_uri=..., run_id=...))
        self._client = client if run_id is not None else None

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params (values as text). A key logged twice must keep its value: MLflow refuses a change."""
        if not self.enabled or not params:
            return
        from mlflow.entities import Param

        self._client.log_batch(self.run_id, params=[Param(str(k), _text(v)) for k, v in params.items()])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log scalar metrics at ``step`` (0 when None)."""
        if not self.enabled or not metrics:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(str(k), float(v), now, int(step or 0)) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set tags (values as text; a tag may be overwritten)."""
        if not self.enabled or not tags:
            return
        from mlflow.entities import RunTag

        self._client.log_batch(self.run_id, tags=[RunTag(str(k), _text(v, 8000)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file, or a folder (kept as a folder of that name), into the run's artifacts."""
        if not self.enabled:
            return
        path = Path(path)
        if path.is_dir():
            sub = f"{artifact_path}/{path.name}" if artifact_path else path.name
            self._client.log_artifacts(self.run_id, str(path), sub)
        elif path.is_file():
            self._client.log_artifact(self.run_id, str(path), artifact_path)
        else:
            raise PolyspecError(f"cannot log artifact {path}: no such file or folder", exit_code=1)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Write ``text`` as the artifact ``artifact_file`` (a relative path such as ``notes/summary.md``)."""
        if not self.enabled:
            return
        self._client.log_text(self.run_id, text, artifact_file)


def _ensure_experiment(client: Any, uri: str, name: str) -> str:
    """The id of experiment ``name`` in the store, creating it (with :func:`artifact_location`) if needed."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location(uri))
        except MlflowException:  # created meanwhile by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise PolyspecError(
            f"MLflow experiment {name!r} in {uri} is deleted; restore it (`mlflow experiments restore`) or set "
            "tracking.experiment to another name",
            exit_code=2,
        )
    return exp.experiment_id


def _open_store(uri: str) -> Any:
    """An MlflowClient for ``uri``, with a sqlite file's folder created; store errors become PolyspecError."""
    from mlflow import MlflowClient

    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    try:
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # opens (and for a new sqlite file, creates) the store
    except Exception as exc:  # any store failure: bad scheme, unreadable file, server down
        raise PolyspecError(
            f"could not open the MLflow tracking store {uri!r} ({type(exc).__name__}: {exc}). Fix tracking.uri or "
            "$MLFLOW_TRACKING_URI, or set tracking.enabled=false",
            exit_code=1,
        ) from None
    return client


def _run_tags(recipe: Recipe, stage: str, command: list[str] | None) -> tuple[dict[str, str], dict[str, Any]]:
    """Tags for a new run, and the full stamp (software + hardware + command) logged as ``stamp.json``."""
    from polyspec.stamp import command_line, hardware_stamp, software_stamp

    cmd = shlex.join(command) if command is not None else command_line()
    software = software_stamp()
    hardware = hardware_stamp()
    tags = {
        "polyspec.stage": stage,
        "polyspec.command": cmd,
        "polyspec.version": software["polyspec"],
        "polyspec.workdir": str(Path(recipe.workdir).resolve()),
        "polyspec.git_dirty": str(software["git_dirty"]),
        "python.version": software["python"],
        "hardware.cpu": str(hardware["cpu"]),
        "hardware.cuda": ", ".join(d["name"] for d in hardware["cuda"].get("devices", [])) or "none",
    }
    if software["git_sha"]:
        tags["polyspec.git_sha"] = software["git_sha"]
        tags["mlflow.source.git.commit"] = software["git_sha"]
    tags.update({f"version.{name}": v for name, v in software["packages"].items()})
    return tags, {"command": cmd, "software": software, "hardware": hardware}


def _end(client: Any, run_id: str, status: str) -> None:
    """End our run with ``status``. If the block left MLflow's active-run stack with another run on top (or ended
    ours itself), only our run's status is set: runs we did not start are never ended."""
    import mlflow

    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        mlflow.end_run(status)
    else:
        if active is not None:
            log.warning("MLflow run %s is still active above %s; leaving it open", active.info.run_id, run_id)
        client.set_terminated(run_id, status)


@contextmanager
def start_run(
    recipe: Recipe, stage: str, *, command: list[str] | None = None, nested: bool = False
) -> Iterator[Tracker]:
    """Open an MLflow run for ``stage`` (e.g. ``run``, ``train``, ``quantize``) and yield its :class:`Tracker`.

    The run nests under MLflow's active run when there is one (``nested=True`` says it is expected: a stage under
    ``polyspec run``; with ``nested=False`` an already active run, such as a notebook's, becomes its parent too). In
    that case it lives in the parent's store and experiment; otherwise in :func:`tracking_uri` under
    ``tracking.experiment``. ``command`` (default ``sys.argv``) is recorded as the command line.
    """
    if not recipe.tracking.enabled:
        yield Tracker()
        return
    import mlflow

    parent = mlflow.active_run()
    tags, stamp = _run_tags(recipe, stage, command)
    restore_uri: tuple[str | None] | None = None  # set when this call changed MLflow's global tracking URI
    if parent is None:
        if nested:
            log.info("no active MLflow run: %s starts a top-level run", stage)
        restore_uri = (mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None,)
        tracker = _top_level_run(recipe, stage, tags)
    else:
        if not nested:
            log.info("MLflow run %s is active: %s nests under it", parent.info.run_id, stage)
        tracker = _nested_run(recipe, stage, tags, parent)
    try:
        try:
            tracker.log_text(recipe_to_yaml(recipe), "recipe.yaml")
            tracker.log_text(json.dumps(stamp, indent=2) + "\n", "stamp.json")
            tracker.log_params(flatten(recipe.model_dump(mode="json")))
            yield tracker
        except BaseException as exc:
            _end_quietly(tracker, "FAILED" if isinstance(exc, Exception) else "KILLED")
            raise
        _end(tracker._client, tracker.run_id, "FINISHED")
    finally:
        if restore_uri is not None:
            mlflow.set_tracking_uri(restore_uri[0])


def _top_level_run(recipe: Recipe, stage: str, tags: dict[str, str]) -> Tracker:
    """A run in :func:`tracking_uri`'s store under ``tracking.experiment``; MLflow's global URI set to that store
    (the caller restores it), and restored here when the run does not start."""
    import mlflow

    uri = tracking_uri(recipe)
    client = _open_store(uri)
    experiment_id = _ensure_experiment(client, uri, recipe.tracking.experiment)
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        run = mlflow.start_run(experiment_id=experiment_id, run_name=stage, tags=tags)
    except BaseException:
        mlflow.set_tracking_uri(before)
        raise
    return Tracker(run.info.run_id, client, experiment_id, uri)


def _nested_run(recipe: Recipe, stage: str, tags: dict[str, str], parent: Any) -> Tracker:
    """A run nested under MLflow's active run ``parent``, in the parent's store and experiment."""
    import mlflow
    from mlflow import MlflowClient

    uri = mlflow.get_tracking_uri()
    if recipe.tracking.uri and recipe.tracking.uri != uri:
        log.warning("tracking.uri=%s is ignored: %s nests under the active MLflow run in %s", recipe.tracking.uri,
                    stage, uri)
    experiment_id = parent.info.experiment_id
    run = mlflow.start_run(experiment_id=experiment_id, run_name=stage, nested=True, tags=tags)
    return Tracker(run.info.run_id, MlflowClient(tracking_uri=uri), experiment_id, uri)


def _end_quietly(tracker: Tracker, status: str) -> None:
    """End the run as ``status``; a failure to do so is logged, never raised (it would hide the block's own)."""
    try:
        _end(tracker._client, tracker.run_id, status)
    except Exception as end_exc:
        log.warning("could not end MLflow run %s: %s", tracker.run_id, end_exc)

