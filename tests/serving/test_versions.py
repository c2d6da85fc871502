"""Version discovery, version policies, labels, config reloads and failed loads."""

import os
import shutil
import time

import grpc
import pytest
from tensorflow_serving.apis import model_management_pb2, model_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

from tests.serving import models
from tfformer import serving
from tfformer.serving import config as config_lib
from tfformer.serving.manager import aspired_versions, list_versions


@pytest.fixture(scope="module")
def text_versions(tmp_path_factory):
    """Saved text models (version marker 1..3) to copy into base paths."""
    root = tmp_path_factory.mktemp("text_versions")
    for version in (1, 2, 3):
        models.save_text(root / str(version), version=version)
    return root


def publish(text_versions, base, version, name=None):
    """Copies a saved version next to `base`, then renames it in (an atomic publish)."""
    staging = base.parent / f".staging-{version}"
    shutil.copytree(text_versions / str(version), staging)
    os.rename(staging, base / (name or str(version)))


def states(server, model):
    return {int(entry["version"]): entry["state"]
            for entry in serving.Client(server.rest_url).status(model)["model_version_status"]}


def wait_for(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)


def test_list_versions_ignores_non_versions(tmp_path, text_versions):
    base = tmp_path / "m"
    base.mkdir()
    publish(text_versions, base, 1, name="0001")           # zero-padded: version 1
    publish(text_versions, base, 2, name=".tmp-2-123")    # the exporter's temporary name
    publish(text_versions, base, 3, name="3.tmp")
    shutil.copytree(text_versions / "3", base / "4")
    os.remove(base / "4" / "saved_model.pb")              # half-written: no saved_model.pb yet
    (base / "5").write_text("not a directory")
    (base / "-6").mkdir()
    assert list_versions(base) == {1: str(base / "0001")}


def test_policies():
    found = {1: "a", 2: "b", 3: "c"}
    policy = model_server_config_pb2.ModelConfig().model_version_policy
    assert aspired_versions(policy, found) == {3: "c"}  # default: latest 1
    policy.latest.num_versions = 2
    assert aspired_versions(policy, found) == {2: "b", 3: "c"}
    policy.all.SetInParent()
    assert aspired_versions(policy, found) == found
    policy.specific.versions.extend([1, 3, 7])
    assert aspired_versions(policy, found) == {1: "a", 3: "c"}


def test_new_version_is_loaded_before_the_old_one_is_unloaded(tmp_path, text_versions):
    base = tmp_path / "m"
    base.mkdir()
    publish(text_versions, base, 1)
    with serving.Server(model_name="m", model_base_path=str(base), file_system_poll_wait_seconds=0.1) as server:
        client = serving.Client(server.rest_url)
        assert client.predict("m", ["a"])["version"].tolist() == [1]
        # Incomplete (no saved_model.pb), and never complete: copying it in and deleting the file afterwards
        # left a window in which the 0.1 s poll could see a whole version 3.
        shutil.copytree(text_versions / "3", base / "3", ignore=shutil.ignore_patterns("saved_model.pb"))
        time.sleep(0.5)
        assert states(server, "m") == {1: "AVAILABLE"}
        publish(text_versions, base, 2)
        wait_for(lambda: states(server, "m") == {2: "AVAILABLE", 1: "END"})
        assert client.predict("m", ["a"])["version"].tolist() == [2]
        with pytest.raises(serving.ServingError, match=r"Servable not found for request: Specific\(m, 1\)"):
            client.predict("m", ["a"], version=1)


def test_version_policies_from_a_config_file(tmp_path, text_versions):
    base = tmp_path / "m"
    base.mkdir()
    for version in (1, 2, 3):
        publish(text_versions, base, version)
    config = tmp_path / "models.config"
    config.write_text(f"""model_config_list {{
      config {{ name: 'latest2' base_path: '{base}' model_platform: 'tensorflow'
               model_version_policy {{ latest {{ num_versions: 2 }} }} }}
      config {{ name: 'all' base_path: '{base}' model_platform: 'tensorflow' model_version_policy {{ all {{}} }} }}
      config {{ name: 'specific' base_path: 'm' model_platform: 'tensorflow'
               model_version_policy {{ specific {{ versions: 1 versions: 3 }} }} }}
    }}""")
    with serving.Server(model_config_file=str(config), file_system_poll_wait_seconds=0) as server:
        assert states(server, "latest2") == {3: "AVAILABLE", 2: "AVAILABLE"}
        assert states(server, "all") == {3: "AVAILABLE", 2: "AVAILABLE", 1: "AVAILABLE"}
        assert states(server, "specific") == {3: "AVAILABLE", 1: "AVAILABLE"}
        assert serving.Client(server.grpc_url).predict("specific", ["a"])["version"].tolist() == [3]


def _reload(server, text):
    stub = model_service_pb2_grpc.ModelServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.ports.grpc}"))
    request = model_management_pb2.ReloadConfigRequest()
    request.config.CopyFrom(config_lib.parse_config_text(text))
    return stub.HandleReloadConfigRequest(request, timeout=60)


def test_labels_and_reload_config(tmp_path, text_versions):
    base = tmp_path / "m"
    base.mkdir()
    for version in (1, 2):
        publish(text_versions, base, version)
    model = f"name: 'm' base_path: '{base}' model_platform: 'tensorflow' " \
            "model_version_policy { specific { versions: 1 versions: 2 } }"
    config = model_server_config_pb2.ModelServerConfig()
    config.CopyFrom(config_lib.parse_config_text(
        f"model_config_list {{ config {{ {model} version_labels {{ key: 'stable' value: 1 }} }} }}"))
    with serving.Server(config=config, file_system_poll_wait_seconds=0) as server:
        client = serving.Client(server.rest_url)
        assert client.predict("m", ["a"], label="stable")["version"].tolist() == [1]
        response = _reload(server, f"model_config_list {{ config {{ {model} version_labels {{ key: 'stable' value: 1 }}"
                                   " version_labels { key: 'canary' value: 2 } } }")
        assert response.status.error_code == 0
        assert client.predict("m", ["a"], label="canary")["version"].tolist() == [2]
        with pytest.raises(grpc.RpcError) as raised:
            _reload(server, f"model_config_list {{ config {{ {model} version_labels {{ key: 'next' value: 3 }} }} }}")
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert raised.value.details() == ("Request to assign label to version 3 of model m, which is not currently "
                                          "available for inference")
        # The failed reload changed nothing.
        assert client.predict("m", ["a"], label="canary")["version"].tolist() == [2]
        other = tmp_path / "other"
        other.mkdir()
        publish(text_versions, other, 3)
        _reload(server, f"model_config_list {{ config {{ name: 'other' base_path: '{other}' "
                        "model_platform: 'tensorflow' } }")
        assert client.predict("other", ["a"])["version"].tolist() == [3]
        with pytest.raises(serving.ServingError, match=r"Latest\(m\)"):
            client.predict("m", ["a"])  # models missing from the new config are unloaded
        assert states(server, "m") == {2: "END", 1: "END"}
        with pytest.raises(serving.ServingError, match="Unrecognized servable version label: canary"):
            client.predict("m", ["a"], label="canary")


def test_config_file_is_polled(tmp_path, text_versions):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        publish(text_versions, tmp_path / name, 1)
    config = tmp_path / "models.config"
    entry = "config {{ name: '{0}' base_path: '{0}' model_platform: 'tensorflow' }}"
    config.write_text(f"model_config_list {{ {entry.format('a')} }}")
    with serving.Server(model_config_file=str(config), model_config_file_poll_wait_seconds=0.1,
                        file_system_poll_wait_seconds=0) as server:
        client = serving.Client(server.rest_url)
        config.write_text(f"model_config_list {{ {entry.format('a')} {entry.format('b')} }}")
        wait_for(lambda: states(server, "b") == {1: "AVAILABLE"} if server.manager.available_versions("b") else False)
        assert client.predict("b", ["x"])["version"].tolist() == [1]


def test_failed_load_keeps_the_old_version(tmp_path, text_versions):
    base = tmp_path / "m"
    base.mkdir()
    publish(text_versions, base, 1)
    with serving.Server(model_name="m", model_base_path=str(base), file_system_poll_wait_seconds=0.1,
                        max_num_load_retries=1, load_retry_interval_micros=10_000) as server:
        broken = tmp_path / ".broken"
        broken.mkdir()
        (broken / "saved_model.pb").write_bytes(b"not a SavedModel")
        os.rename(broken, base / "2")
        wait_for(lambda: states(server, "m").get(2) == "END")
        status = serving.Client(server.rest_url).status("m", version=2)["model_version_status"][0]["status"]
        assert status["error_code"] == "UNKNOWN" and status["error_message"]
        assert states(server, "m")[1] == "AVAILABLE"
        assert serving.Client(server.grpc_url).predict("m", ["a"])["version"].tolist() == [1]


def test_startup_fails_when_no_version_loads(tmp_path):
    base = tmp_path / "m" / "1"
    base.mkdir(parents=True)
    (base / "saved_model.pb").write_bytes(b"garbage")
    server = serving.Server(model_name="m", model_base_path=str(tmp_path / "m"), max_num_load_retries=0)
    with pytest.raises(serving.ServingError) as raised:
        server.start()
    assert raised.value.code == serving.Code.UNKNOWN
    assert raised.value.message.startswith(
        "1 model(s) did not become available: {{{name: m version: 1} due to error: UNKNOWN: ")
