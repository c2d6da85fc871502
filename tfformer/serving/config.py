"""`ModelServerConfig`: the `--model_config_file` text proto, or one model from flags.

models.config is parsed with TF Serving's own proto
(`tensorflow_serving.config.model_server_config_pb2`), so a file that works
with `tensorflow_model_server` works here:

    model_config_list {
      config { name: 'encoder' base_path: '/models/encoder' model_platform: 'tensorflow'
               model_version_policy { specific { versions: 1 versions: 2 } }
               version_labels { key: 'stable' value: 1 } }
    }
"""

import os

from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from tfformer.serving.status import Code, ServingError, invalid_argument

SUPPORTED_PLATFORMS = ("tensorflow",)


def single_model_config(model_name, model_base_path):
    """The config `tensorflow_model_server --model_name --model_base_path` builds."""
    config = model_server_config_pb2.ModelServerConfig()
    model = config.model_config_list.config.add()
    model.name = model_name
    model.base_path = os.path.abspath(model_base_path)
    model.model_platform = "tensorflow"
    return config


def parse_config_text(text, relative_to=None):
    """Parses a models.config text proto.

    Args:
        text: str. The text-format `ModelServerConfig`.
        relative_to: optional directory. Relative `base_path`s are resolved against it (TF Serving
            itself requires absolute paths; this is a convenience for local development).

    Raises:
        ValueError: the text is not a valid `ModelServerConfig`.
    """
    config = model_server_config_pb2.ModelServerConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as error:
        raise ValueError(f"Invalid model server config: {error}") from None
    if relative_to is not None:
        for model in config.model_config_list.config:
            if model.base_path and not os.path.isabs(model.base_path) and "://" not in model.base_path:
                model.base_path = os.path.normpath(os.path.join(relative_to, model.base_path))
    return config


def read_config_file(path):
    """Reads `--model_config_file` (relative base paths resolve against the file's directory)."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"Cannot read the model config file {path}: {error}") from None
    return parse_config_text(text, relative_to=os.path.dirname(os.path.abspath(path)))


def validate(config):
    """The checks `ServerCore::ReloadConfig` makes before applying a config.

    Raises:
        ServingError: INVALID_ARGUMENT for an unsupported config kind, a duplicate name, a relative base
            path, or a missing or unsupported platform.
    """
    kind = config.WhichOneof("config")
    if kind is None:
        return
    if kind != "model_config_list":
        raise ServingError(Code.INVALID_ARGUMENT, "ServerModelConfig type not supported by "
                           "HandleReloadConfigRequest. Only ModelConfigList is currently supported")
    names = set()
    for model in config.model_config_list.config:
        if model.name in names:
            raise invalid_argument(f"Illegal to list model {model.name} multiple times in config list")
        names.add(model.name)
        if not os.path.isabs(model.base_path) and "://" not in model.base_path:
            raise invalid_argument(f"Expected model {model.name} to have an absolute path or URI; "
                                   f"got base_path()={model.base_path}")
        if "://" in model.base_path:
            raise invalid_argument(f"Model {model.name}: only local file system base paths are supported by the "
                                   f"embedded server; got base_path()={model.base_path}")
        if model.model_type == model_server_config_pb2.TENSORFLOW and not model.model_platform:
            continue  # the deprecated `model_type: TENSORFLOW`
        if model.model_type != model_server_config_pb2.MODEL_TYPE_UNSPECIFIED and model.model_platform:
            raise invalid_argument("Illegal setting both ModelServerConfig::model_type (deprecated) and "
                                   "ModelServerConfig::model_platform.")
        if not model.model_platform:
            raise invalid_argument("Illegal setting neither ModelServerConfig::model_type (deprecated) nor "
                                   "ModelServerConfig::model_platform.")
        if model.model_platform not in SUPPORTED_PLATFORMS:
            raise invalid_argument(f"Model {model.name} requests unsupported platform {model.model_platform}")
