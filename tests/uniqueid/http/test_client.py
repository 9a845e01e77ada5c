"""The vLLM client against real HTTP servers on loopback (no mocks).

``Recorder`` is a server that records every request and answers like vLLM
(200 bodies, 400/500 with vLLM's error shape); the reference server
(``jax_sender.testing.server`` with no GPU workers) applies vLLM's validation rules.
"""

import base64
import json
import time

import pytest

from jax_sender.testing.harness import ReferenceServer
from uniqueid import InitInfo, UniqueId, UpdateInfo, VLLMClient, VLLMConnectionError, VLLMHTTPError
from uniqueid.http.client import Encoded

from support.servers.recorder import Recorder


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.close()


def body(req):
    return json.loads(req[2]) if req[2] else None


def test_every_route_sends_vllms_exact_body(recorder):
    c = VLLMClient(recorder.url, api_key="secret")
    uid = UniqueId.mint()
    info = InitInfo(nccl_unique_id_b64=uid.to_b64(), rank_offset=1, world_size=3)
    recorder.answers["/get_world_size"] = (200, {"world_size": 2})
    recorder.answers["/is_paused"] = (200, {"is_paused": True})
    recorder.answers["/weight_info"] = (200, {"weight_version": "v3"})
    assert c.get_world_size() == 2
    c.init_weight_transfer_engine(info.to_payload())
    c.start_weight_update()
    c.update_weights(UpdateInfo(["a.weight"], ["bfloat16"], [[2, 3]]).to_payload())
    c.update_weights(UpdateInfo().to_payload())
    c.finish_weight_update("v12")
    c.finish_weight_update()
    c.pause("keep")
    c.resume()
    assert c.is_paused() is True
    assert c.weight_info() == {"weight_version": "v3"}
    c.weight_checker("compare", {"k": "d"})
    c.shutdown_weight_transfer_engine()
    got = [(m, p, r[2]) for m, p, r, _ in [(q[0], q[1], q, None) for q in recorder.requests]]
    expect = [
        ("GET", "/get_world_size", b""),
        ("POST", "/init_weight_transfer_engine",
         b'{"init_info":{"nccl_unique_id_b64":"' + base64.b64encode(uid.raw) +
         b'","rank_offset":1,"world_size":3,"packed":true,'
         b'"packed_buffer_size_bytes":1073741824,"packed_num_buffers":2}}'),
        ("POST", "/start_weight_update", b""),
        ("POST", "/update_weights",
         b'{"update_info":{"names":["a.weight"],"dtype_names":["bfloat16"],"shapes":[[2,3]]}}'),
        ("POST", "/update_weights", b'{"update_info":{"names":[],"dtype_names":[],"shapes":[]}}'),
        ("POST", "/finish_weight_update", b'{"weight_version":"v12"}'),
        ("POST", "/finish_weight_update", b""),
        ("POST", "/pause?mode=keep", b""),
        ("POST", "/resume", b""),
        ("GET", "/is_paused", b""),
        ("GET", "/weight_info", b""),
        ("POST", "/weight_checker", b'{"action":"compare","baseline":{"k":"d"}}'),
        ("POST", "/shutdown_weight_transfer_engine", b""),
    ]
    assert got == expect
    assert all(r[3]["authorization"] == "Bearer secret" for r in recorder.requests)
    assert all(r[3].get("content-type") == "application/json"
               for r in recorder.requests if r[2])


def test_a_payload_encoded_once_is_sent_to_the_byte_as_the_payload_itself(recorder):
    """An update's payload encoded once for a fleet (``Encoded``) makes the
    body the payload makes, non-ASCII names and nested lists included."""
    c = VLLMClient(recorder.url)
    payload = UpdateInfo(["l\u00e9.0.w", "b"], ["bfloat16", "float32"], [[2, 3], []]).to_payload()
    c.update_weights(payload)
    c.update_weights(Encoded(payload))
    c.weight_checker("compare", Encoded({"k": "d"}))
    c.weight_checker("compare", {"k": "d"})
    bodies = [r[2] for r in recorder.requests]
    assert bodies[0] == bodies[1] and bodies[2] == bodies[3]
    assert json.loads(bodies[1]) == {"update_info": payload}
    c.close()


@pytest.mark.parametrize("value", [float("nan"), {"x": float("inf")}, {1, 2}], ids=repr)
def test_only_json_is_encoded(value):
    with pytest.raises((ValueError, TypeError)):
        Encoded(value)


def test_newer_keys_only_when_asked():
    b64 = UniqueId.mint().to_b64()
    plain = InitInfo(nccl_unique_id_b64=b64, rank_offset=1, world_size=2).to_payload()
    assert set(plain) == {"nccl_unique_id_b64", "rank_offset", "world_size", "packed",
                          "packed_buffer_size_bytes", "packed_num_buffers"}
    plan = InitInfo(nccl_unique_id_b64=b64, rank_offset=1, world_size=2, use_load_plan=True,
                    metadata=[["w", "bfloat16", [2]]]).to_payload()
    assert plan["use_load_plan"] is True and plan["metadata"] == [["w", "bfloat16", [2]]]
    assert "src" not in UpdateInfo(["w"], ["float32"], [[1]]).to_payload()
    assert UpdateInfo(["w"], ["float32"], [[1]], src=2).to_payload()["src"] == 2


@pytest.mark.parametrize("kwargs,exc", [
    (dict(rank_offset="1", world_size=2), TypeError),
    (dict(rank_offset=1, world_size=2, packed=1), TypeError),
    (dict(rank_offset=1, world_size=True), TypeError),
    (dict(rank_offset=1, world_size=1), ValueError),
    (dict(rank_offset=1, world_size=2, packed_num_buffers=0), ValueError),
    (dict(rank_offset=1, world_size=2, use_load_plan=True), ValueError),
    (dict(rank_offset=1, world_size=2, master_port=29500), ValueError),
])
def test_init_info_is_typed(kwargs, exc):
    with pytest.raises(exc):
        InitInfo(nccl_unique_id_b64=UniqueId.mint().to_b64(), **kwargs)


def test_update_info_lengths():
    with pytest.raises(ValueError, match="dtype_names"):
        UpdateInfo(["a", "b"], ["float32"], [[1], [2]])
    with pytest.raises(ValueError, match="shapes"):
        UpdateInfo(["a"], ["float32"], [])


@pytest.mark.parametrize("status,payload,message", [
    (500, {"error": {"message": "Call to collective_rpc method failed: boom", "type":
                     "InternalServerError", "param": None, "code": 500}},
     "Call to collective_rpc method failed: boom"),
    (400, {"error": {"message": "bad body", "type": "BadRequestError", "param": None,
                     "code": 400}}, "bad body"),
    (404, {"detail": "Not Found"}, "Not Found"),
])
def test_http_errors_carry_vllms_message(recorder, status, payload, message):
    recorder.answers["/start_weight_update"] = (status, payload)
    with pytest.raises(VLLMHTTPError) as e:
        VLLMClient(recorder.url).start_weight_update()
    assert e.value.status == status and e.value.message == message
    assert e.value.route == "/start_weight_update"
    if status == 404:
        assert "VLLM_SERVER_DEV_MODE=1" in str(e.value)


def test_read_timeout_is_enforced():
    slow = Recorder(delay=2.0)
    try:
        t = time.monotonic()
        with pytest.raises(VLLMConnectionError, match="no answer within the timeout"):
            VLLMClient(slow.url, timeout=0.3).get_world_size()
        assert time.monotonic() - t < 1.5
    finally:
        slow.close()


def test_unreachable_server():
    with pytest.raises(VLLMConnectionError):
        VLLMClient("http://127.0.0.1:1", connect_timeout=1).get_world_size()


# -- the reference server's vLLM rules (no GPU workers) ----------------------

@pytest.fixture(scope="module")
def reference():
    with ReferenceServer([]) as url:
        yield VLLMClient(url)


def test_reference_server_session_rules(reference):
    c = reference
    assert c.get_world_size() == 0
    with pytest.raises(VLLMHTTPError, match="start_weight_update must be called") as e:
        c.update_weights(UpdateInfo().to_payload())
    assert e.value.status == 500
    with pytest.raises(VLLMHTTPError, match="without a matching"):
        c.finish_weight_update()
    c.start_weight_update()
    with pytest.raises(VLLMHTTPError, match="while an update is active"):
        c.start_weight_update()
    with pytest.raises(VLLMHTTPError, match="cannot shut down"):
        c.shutdown_weight_transfer_engine()
    c.update_weights(UpdateInfo(["w"], ["float32"], [[2]]).to_payload())
    c.finish_weight_update("v7")
    assert c.weight_info()["weight_version"] == "v7"
    c.pause("wait")
    assert c.is_paused()
    c.resume()
    assert not c.is_paused()


@pytest.mark.parametrize("init_info,match", [
    ({"rank_offset": 1, "world_size": 2, "bogus": 1}, "unexpected keyword argument 'bogus'"),
    ({"rank_offset": 1, "world_size": 2, "nccl_unique_id_b64": "abc"}, "padding"),
    ({"rank_offset": 1, "world_size": 2}, "need nccl_unique_id_b64"),
    ({"rank_offset": 1, "world_size": 2, "nccl_unique_id_b64": UniqueId.mint().to_b64(),
      "use_load_plan": True, "metadata": [["w", "float32"]]}, r"\[name, dtype, shape\] triples"),
])
def test_reference_server_refuses_bad_init_like_vllm(reference, init_info, match):
    with pytest.raises(VLLMHTTPError, match=match) as e:
        reference.init_weight_transfer_engine(init_info)
    assert e.value.status == 500


def test_reference_server_bad_bodies_are_400(reference):
    with pytest.raises(VLLMHTTPError) as e:
        reference.request("POST", "/init_weight_transfer_engine", json={"nope": 1})
    assert e.value.status == 400
    with pytest.raises(VLLMHTTPError) as e:
        reference.request("POST", "/no_such_route")
    assert e.value.status == 404


def test_reference_server_failed_update_drops_the_session(reference):
    reference.start_weight_update()
    with pytest.raises(VLLMHTTPError, match="dtype_names"):
        reference.update_weights({"names": ["a"], "dtype_names": [], "shapes": [[1]]})
    with pytest.raises(VLLMHTTPError, match="without a matching"):
        reference.finish_weight_update()


def test_sparse_backend_parses_vllms_sparse_update_info():
    """A server launched with the sparse backend reads ``num_updates_list``; a
    dense body is refused before any collective, like vLLM's worker would."""
    from uniqueid import SparseUpdateInfo
    with ReferenceServer([], backend="sparse_nccl") as url:
        c = VLLMClient(url)
        c.start_weight_update()
        c.update_weights(SparseUpdateInfo(["w"], ["bfloat16"], [[4, 4]], [3]).to_payload())
        with pytest.raises(VLLMHTTPError, match="num_updates_list") as e:
            c.update_weights(UpdateInfo(["w"], ["bfloat16"], [[4, 4]]).to_payload())
        assert e.value.status == 500
        c.start_weight_update()  # the failed update dropped the session
        with pytest.raises(VLLMHTTPError, match="cannot be empty"):
            c.update_weights({"names": [], "dtype_names": [], "shapes": [],
                              "num_updates_list": []})


def test_making_clients_costs_next_to_nothing():
    """A fleet's clients are made before its connect: 256 of them take no
    TLS context, no connection and no thread (each once took a TLS context:
    about 40 ms and 0.8 MB)."""
    import threading
    import tracemalloc

    threads = threading.active_count()
    tracemalloc.start()
    start = time.monotonic()
    try:
        clients = [VLLMClient(f"http://127.0.0.1:{9000 + i}") for i in range(256)]
        took = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 2.0, f"{took:.2f} s"
    assert peak < 16 * 2**20, f"{peak >> 20} MiB"
    assert threading.active_count() <= threads
    for c in clients:
        c.close()
