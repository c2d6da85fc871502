"""`ModelServerConfig`: the `--model_config_file` text proto, or one model from flags.

models.config is parsed with TF Serving's own proto
(`tensorflow_serving.config.model_server_config_pb2`), so a file that works
with `tensorflow_model_server` works here:

    model_config_list {
      config { name: 'encoder' base_path: '/models/encoder' model_platform: 'tensorflow'
               model_version_policy { specific { versions: 1 versions: 2 } }
               version_labels { key: 'stable' value: 1 } }
    }

It also reads the other text protos of `tensorflow_model_server`'s flags whose messages
`tensorflow-serving-api` does not ship: `--batching_parameters_file` (`BatchingParameters`,
servables/tensorflow/session_bundle_config.proto) and `--monitoring_config_file` (`MonitoringConfig`,
config/monitoring_config.proto). Their messages are built here from the same field names, numbers and
types, so a file TF Serving accepts parses the same way, and an unknown field is an error:

    max_batch_size { value: 32 }
    batch_timeout_micros { value: 0 }
    allowed_batch_sizes: 8  allowed_batch_sizes: 32
"""

import functools
import os

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format, wrappers_pb2
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


_FIELD = descriptor_pb2.FieldDescriptorProto
# TF Serving's messages that the pip package lacks: name -> [(field, number, type, message type or None, repeated)]
_MESSAGES = {
    "BatchingParameters": [
        ("max_batch_size", 1, _FIELD.TYPE_MESSAGE, ".google.protobuf.Int64Value", False),
        ("batch_timeout_micros", 2, _FIELD.TYPE_MESSAGE, ".google.protobuf.Int64Value", False),
        ("max_enqueued_batches", 3, _FIELD.TYPE_MESSAGE, ".google.protobuf.Int64Value", False),
        ("num_batch_threads", 4, _FIELD.TYPE_MESSAGE, ".google.protobuf.Int64Value", False),
        ("thread_pool_name", 5, _FIELD.TYPE_MESSAGE, ".google.protobuf.StringValue", False),
        ("allowed_batch_sizes", 6, _FIELD.TYPE_INT64, None, True),
        ("pad_variable_length_inputs", 7, _FIELD.TYPE_BOOL, None, False),
        ("enable_large_batch_splitting", 8, _FIELD.TYPE_MESSAGE, ".google.protobuf.BoolValue", False),
        ("max_execution_batch_size", 9, _FIELD.TYPE_MESSAGE, ".google.protobuf.Int64Value", False),
    ],
    "PrometheusConfig": [
        ("enable", 1, _FIELD.TYPE_BOOL, None, False),
        ("path", 2, _FIELD.TYPE_STRING, None, False),
    ],
    "MonitoringConfig": [
        ("prometheus_config", 1, _FIELD.TYPE_MESSAGE, ".tensorflow.serving.PrometheusConfig", False),
    ],
}


@functools.cache
def message_class(name):
    """The class of one of TF Serving's `_MESSAGES` (package `tensorflow.serving`), in a descriptor pool of its own."""
    proto = descriptor_pb2.FileDescriptorProto(name="tfformer/serving/tensorflow_serving_messages.proto",
                                               package="tensorflow.serving", syntax="proto3",
                                               dependency=["google/protobuf/wrappers.proto"])
    for message_name, fields in _MESSAGES.items():
        message = proto.message_type.add(name=message_name)
        for field, number, kind, type_name, repeated in fields:
            message.field.add(name=field, number=number, type=kind, type_name=type_name,
                              label=_FIELD.LABEL_REPEATED if repeated else _FIELD.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tensorflow.serving.{name}"))


def read_text_proto(path, name):
    """`ParseProtoTextFile`: the text-format message `name` (one of `_MESSAGES`) in the file `path`.

    Raises:
        ValueError: the file cannot be read, or is not a valid `name` (TF Serving's "Invalid protobuf file"
            message, followed by the parser's, which names the line, column and field).
    """
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"Cannot read {path}: {error}") from None
    try:
        return text_format.Parse(text, message_class(name)())
    except text_format.ParseError as error:
        raise ValueError(f"Invalid protobuf file: '{path}': {error}") from None
