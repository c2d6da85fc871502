"""An embedded server speaking TensorFlow Serving's REST and gRPC APIs, and a client for both.

`tfformer serve` / `Server` serve the export directory `tensorflow/serving`
serves in production (`base_path/<version>/saved_model.pb`, or a models.config),
with TF Serving's endpoints, JSON, error messages, status codes, version
policies and labels; `Client` talks to either. See `tfformer/serving/README.md`.
"""

from tfformer.serving.batching import BatchingOptions
from tfformer.serving.client import Client, predict_texts
from tfformer.serving.manager import ModelManager
from tfformer.serving.server import AccessLog, Ports, Server, run_server
from tfformer.serving.status import Code, ServingError

__all__ = ["AccessLog", "BatchingOptions", "Client", "Code", "ModelManager", "Ports", "Server", "ServingError",
           "predict_texts", "run_server"]
