"""Which versions of which models are loaded: polling, version policies, labels, status.

This is TF Serving's ServerCore + FileSystemStoragePathSource +
AvailabilityPreservingPolicy + ServableStateMonitor, for local SavedModels:

- Each model's `base_path` is listed every `poll_wait_seconds`. A child is a
  version iff its name is a non-negative int64 (`00012` is 12; `.tmp-3`,
  `3.tmp` are ignored) and it is a directory holding `saved_model.pb` (TF
  Serving checks nothing inside; requiring the file skips half-written exports).
- The version policy (`latest {num_versions: N}` (default N=1), `all {}`,
  `specific {versions: ...}`) picks the aspired versions among them.
- New aspired versions load in the background. A version that is no longer
  aspired is unloaded only once an aspired version is available (or none is
  aspired any more): new before old, so requests never see zero versions.
  In-flight requests keep the servable they started with.
- A loaded version replays its warm-up records (`assets.extra/tf_serving_warmup_requests`,
  `tfformer.serving.warmup`) before it becomes AVAILABLE: a new version takes no
  request until it is warm, and the version it replaces serves until then. A
  failed warm-up fails the load.
- A failed load is retried `max_num_load_retries` times,
  `load_retry_interval_seconds` apart, then the version ends with its error
  (its status code: a warm-up request's own, UNKNOWN for other failures).
- Version labels come from the config. A label may only point at an available
  version unless `allow_version_labels_for_unavailable_models`.
"""

import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

from tensorflow_serving.apis import get_model_status_pb2
from tensorflow_serving.config import model_server_config_pb2

from tfformer.checks import check_int
from tfformer.serving import config as config_lib
from tfformer.serving import warmup
from tfformer.serving.servable import Servable, has_saved_model
from tfformer.serving.status import Code, ServingError, failed_precondition, invalid_argument, not_found

log = logging.getLogger("tfformer.serving")

START, LOADING, AVAILABLE, UNLOADING, END = "START", "LOADING", "AVAILABLE", "UNLOADING", "END"
_VERSION_NAME = re.compile(r"\+?[0-9]+")
_INT64_MAX = 2**63 - 1


class _Version:
    """One version of one model, and its state in the servable state monitor."""

    def __init__(self, model, version, path):
        self.model, self.version, self.path = model, version, path
        self.state, self.error, self.servable, self.aspired = START, None, None, True


class _Model:
    def __init__(self, model_config):
        self.name = model_config.name
        self.config = model_config
        self.versions = {}  # version -> _Version (the current ones)
        self.warned_empty = None


def aspired_versions(policy, found):
    """Applies a `ServableVersionPolicy` to `{version: path}` found on disk."""
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return dict(found)
    if choice == "specific":
        return {version: found[version] for version in policy.specific.versions if version in found}
    count = max(policy.latest.num_versions, 1) if choice == "latest" else 1
    return {version: found[version] for version in sorted(found)[-count:]}


def list_versions(base_path):
    """`{version: path}` of the complete numeric version directories under `base_path`."""
    found = {}
    for name in sorted(os.listdir(base_path)):
        if not _VERSION_NAME.fullmatch(name) or int(name) > _INT64_MAX:
            continue
        path = os.path.join(base_path, name)
        if os.path.isdir(path) and has_saved_model(path):
            found.setdefault(int(name), path)
    return found


def _load_status(error):
    """`(code, message)` of a failed load: a `ServingError`'s own (a warm-up request's), else UNKNOWN."""
    if isinstance(error, ServingError):
        return error.code, error.message
    return Code.UNKNOWN, str(error) if error else "Load cancelled."


class ModelManager:
    """Loads, serves and unloads model versions according to a `ModelServerConfig`.

    Args:
        poll_wait_seconds: float. How often base paths are listed (`--file_system_poll_wait_seconds`);
            0 lists them only when a config is applied.
        max_num_load_retries: int. Retries of a failed load.
        load_retry_interval_seconds: float. Wait between retries.
        allow_version_labels_for_unavailable_models: bool. Let labels point at versions not loaded yet.
        num_load_threads: int. Versions loading at the same time.
        loader: callable(name, version, path) -> servable. Defaults to `Servable`.
        enable_model_warmup: bool. Replay each version's warm-up records before it serves
            (`--enable_model_warmup`, default on).
        num_request_iterations_for_warmup: int. Runs of each warm-up record; used only if > 0, else 1
            (`--num_request_iterations_for_warmup`).
    """

    def __init__(self, poll_wait_seconds=1.0, max_num_load_retries=5, load_retry_interval_seconds=60.0,
                 allow_version_labels_for_unavailable_models=False, num_load_threads=2, loader=Servable,
                 enable_model_warmup=True, num_request_iterations_for_warmup=0):
        check_int("num_request_iterations_for_warmup", num_request_iterations_for_warmup, minimum=0)
        self.enable_model_warmup = bool(enable_model_warmup)
        self.num_request_iterations_for_warmup = num_request_iterations_for_warmup
        self.poll_wait_seconds = poll_wait_seconds
        self.max_num_load_retries = max_num_load_retries
        self.load_retry_interval_seconds = load_retry_interval_seconds
        self.allow_version_labels_for_unavailable_models = allow_version_labels_for_unavailable_models
        self._loader = loader
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._reload_lock = threading.Lock()
        self._models = {}  # name -> _Model, the configured models
        self._monitor = {}  # name -> {version: _Version}, every version ever seen (the state monitor)
        self._labels = {}  # name -> {label: version}
        self._config = model_server_config_pb2.ModelServerConfig()
        self._load_pool = ThreadPoolExecutor(max(1, num_load_threads), thread_name_prefix="tfformer-serving-load")
        self._stop = threading.Event()
        self._poller = None

    # ---------------------------------------------------------------------------------------
    # Life cycle

    def start(self, config):
        """Applies the first config, waits for its models to load, then polls in the background."""
        self.reload_config(config)
        if self.poll_wait_seconds > 0:
            self._poller = threading.Thread(target=self._poll_loop, name="tfformer-serving-poll", daemon=True)
            self._poller.start()

    def stop(self):
        """Stops polling and loading, and unloads every version."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        self._load_pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for model in self._models.values():
                for version in model.versions.values():
                    version.aspired = False
                    if version.state == AVAILABLE:
                        self._unload(version)
            self._changed.notify_all()

    @property
    def config(self):
        with self._lock:
            copy = model_server_config_pb2.ModelServerConfig()
            copy.CopyFrom(self._config)
            return copy

    # ---------------------------------------------------------------------------------------
    # Config

    def reload_config(self, new_config, wait=True):
        """`ServerCore::ReloadConfig`: applies `new_config` and only it (models not in it are unloaded).

        Raises:
            ServingError: INVALID_ARGUMENT for a bad config, FAILED_PRECONDITION for a label on an
                unavailable version, UNKNOWN if a new model did not become available.
        """
        with self._reload_lock:
            config_lib.validate(new_config)
            if new_config.WhichOneof("config") is None:
                log.info("Taking no action for empty config.")
                return
            first = self._config.WhichOneof("config") is None
            if not first:
                labels = self._labels_for(new_config)  # checked before anything changes, as TF Serving does
            configs = {model.name: model for model in new_config.model_config_list.config}
            added = []
            with self._lock:
                for name in list(self._models):
                    if name not in configs:
                        log.info("Unloading model %s (no longer in the config).", name)
                        model = self._models.pop(name)
                        for version in model.versions.values():
                            version.aspired = False
                        self._reconcile(model)
                for name, model_config in configs.items():
                    if name in self._models:
                        self._models[name].config = model_config
                    else:
                        self._models[name] = _Model(model_config)
                        added.append(name)
                self._config.CopyFrom(new_config)
                if not first:
                    self._labels = labels
                models = list(self._models.values())
            for model in models:
                self._poll_model(model)
            if wait:
                self._wait_until_models_available(added)
            if first:
                labels = self._labels_for(new_config)
                with self._lock:
                    self._labels = labels

    def _labels_for(self, new_config):
        labels = {}
        for model_config in new_config.model_config_list.config:
            for label, version in model_config.version_labels.items():
                existing = self._labels.get(model_config.name, {}).get(label)
                allowed = self.allow_version_labels_for_unavailable_models and existing in (None, version)
                if not allowed and not self._is_available(model_config.name, version):
                    raise failed_precondition(f"Request to assign label to version {version} of model "
                                              f"{model_config.name}, which is not currently available for inference")
                labels.setdefault(model_config.name, {})[label] = version
        return labels

    def _is_available(self, name, version):
        with self._lock:
            model = self._models.get(name)
            return model is not None and version in model.versions and model.versions[version].state == AVAILABLE

    def _wait_until_models_available(self, names):
        """Waits until each model's aspired versions have loaded or failed (`WaitUntilModelsAvailable`)."""
        failed = []
        with self._lock:
            def settled():
                return all(version.state in (AVAILABLE, END)
                           for name in names if name in self._models
                           for version in self._models[name].versions.values() if version.aspired)

            while not settled() and not self._stop.is_set():
                self._changed.wait(0.5)
            for name in names:
                model = self._models.get(name)
                if model is None or not any(version.aspired for version in model.versions.values()):
                    continue  # no versions on disk yet: TF Serving would wait for one; we keep going
                if not any(version.state == AVAILABLE for version in model.versions.values()):
                    errors = [version for version in model.versions.values() if version.aspired and version.error]
                    failed.append((name, errors))
        if failed:
            details = "".join(
                f"{{{{name: {name} version: {version.version}}} due to error: "
                f"{Code(version.error[0]).name}: {version.error[1]}}}, "
                for name, errors in failed for version in errors)
            raise ServingError(Code.UNKNOWN, f"{len(failed)} model(s) did not become available: {{{details}}}")

    # ---------------------------------------------------------------------------------------
    # Polling and loading

    def _poll_loop(self):
        while not self._stop.wait(self.poll_wait_seconds):
            self.poll()

    def poll(self):
        """Lists every base path once and acts on what changed."""
        with self._lock:
            models = list(self._models.values())
        for model in models:
            self._poll_model(model)

    def _poll_model(self, model):
        base_path = model.config.base_path
        try:
            found = list_versions(base_path)
        except OSError as error:
            if model.warned_empty != "missing":
                log.error("File system path %s of model %s cannot be listed: %s", base_path, model.name, error)
                model.warned_empty = "missing"
            found = {}
        if not found and model.warned_empty is None:
            log.warning("No versions of servable %s found under base path %s. Did you forget to name your leaf "
                        "directory as a number (eg. '/1/')?", model.name, base_path)
            model.warned_empty = "empty"
        elif found:
            model.warned_empty = None
        aspired = aspired_versions(model.config.model_version_policy, found)
        with self._lock:
            if self._models.get(model.name) is not model or self._stop.is_set():
                return
            for number, version in model.versions.items():
                version.aspired = number in aspired
            for number in sorted(aspired, reverse=True):  # the highest version loads first
                version = model.versions.get(number)
                if version is None or (version.state == END and version.error is None):
                    version = _Version(model, number, aspired[number])
                    model.versions[number] = version
                    self._monitor.setdefault(model.name, {})[number] = version
                    self._load_pool.submit(self._load, version)
            self._reconcile(model)

    def _load(self, version):
        with self._lock:
            if version.state != START:
                return
            version.state = LOADING
            self._changed.notify_all()
        log.info("Loading servable %s version %d from %s", version.model.name, version.version, version.path)
        servable, error = None, None
        for attempt in range(self.max_num_load_retries + 1):
            try:
                servable = self._loader(version.model.name, version.version, version.path)
                if self.enable_model_warmup:  # still LOADING: no request reaches it before it is warm
                    warmup.run_warmup(servable, version.path, max(self.num_request_iterations_for_warmup, 1))
                break
            except Exception as exc:  # any load failure is reported in the version's status
                servable, error = None, exc
                log.error("Loading servable %s version %d failed (attempt %d): %s", version.model.name,
                          version.version, attempt + 1, exc)
                if attempt == self.max_num_load_retries or self._stop.wait(self.load_retry_interval_seconds):
                    break
                if not version.aspired:
                    break
        with self._lock:
            if servable is None:
                version.state, version.error = END, _load_status(error)
            elif version.aspired and self._models.get(version.model.name) is version.model:
                version.servable, version.state = servable, AVAILABLE
                log.info("Successfully loaded servable %s version %d", version.model.name, version.version)
            else:
                version.state = END
            self._reconcile(version.model)
            self._changed.notify_all()

    def _reconcile(self, model):
        """AvailabilityPreservingPolicy: unload non-aspired versions once it is safe (lock held)."""
        versions = list(model.versions.values())
        aspired = [version for version in versions if version.aspired]
        aspired_available = any(version.state == AVAILABLE for version in aspired)
        unaspired = sorted((version for version in versions if not version.aspired and version.state == AVAILABLE),
                           key=lambda version: version.version)
        while unaspired and (not aspired or aspired_available or len(unaspired) > 1):
            self._unload(unaspired.pop(0))
        self._changed.notify_all()

    def _unload(self, version):
        version.state = UNLOADING
        version.servable = None  # requests in flight still hold their reference
        version.state = END
        log.info("Unloaded servable %s version %d", version.model.name, version.version)

    # ---------------------------------------------------------------------------------------
    # Serving

    def get_servable(self, name, version=None, label=None):
        """`ServerCore::GetServableHandle`: the servable a request for (name, version | label) gets.

        Raises:
            ServingError: INVALID_ARGUMENT for an unknown label, NOT_FOUND when no such version is available.
        """
        if not name:
            raise invalid_argument("ModelSpec has no name specified.")
        with self._lock:
            if label is not None:
                labels = self._labels.get(name, {})
                if label not in labels:
                    raise invalid_argument(f"Unrecognized servable version label: {label}")
                version = labels[label]
            model = self._models.get(name)
            if version is None:
                available = [item for item in (model.versions.values() if model else ()) if item.state == AVAILABLE]
                if not available:
                    raise not_found(f"Servable not found for request: Latest({name})")
                return max(available, key=lambda item: item.version).servable
            item = model.versions.get(version) if model else None
            if item is None or item.state != AVAILABLE:
                raise not_found(f"Servable not found for request: Specific({name}, {version})")
            return item.servable

    def get_servable_for_spec(self, model_spec):
        """`get_servable` from a `ModelSpec` proto (version and version_label are a oneof)."""
        choice = model_spec.WhichOneof("version_choice")
        return self.get_servable(
            model_spec.name,
            version=model_spec.version.value if choice == "version" else None,
            label=model_spec.version_label if choice == "version_label" else None,
        )

    def model_status(self, name, version=None):
        """`GetModelStatusImpl`: a `GetModelStatusResponse` (every version seen, or one)."""
        response = get_model_status_pb2.GetModelStatusResponse()
        with self._lock:
            versions = self._monitor.get(name, {})
            if version is not None:
                if version not in versions:
                    raise not_found(f"Could not find version {version} of model {name}")
                numbers = [version]
            else:
                if not versions:
                    raise not_found(f"Could not find any versions of model {name}")
                numbers = sorted(versions, reverse=True)
            for number in numbers:
                item = versions[number]
                entry = response.model_version_status.add()
                entry.version = number
                entry.state = get_model_status_pb2.ModelVersionStatus.State.Value(item.state)
                code, message = item.error or (Code.OK, "")
                entry.status.error_code = int(code)
                entry.status.error_message = message
        return response

    def wait_for_version(self, name, version, timeout=60.0):
        """Blocks until `version` of `name` is available (a helper for tests and scripts)."""
        with self._lock:
            ok = self._changed.wait_for(lambda: self._is_available(name, version), timeout)
        if not ok:
            raise TimeoutError(f"Version {version} of model {name} did not become available in {timeout} s.")

    def available_versions(self, name):
        with self._lock:
            model = self._models.get(name)
            return sorted(v.version for v in model.versions.values() if v.state == AVAILABLE) if model else []
