"""The policy's adapter manager under concurrent Activate/Unload of one adapter, over real gRPC."""

from __future__ import annotations

import threading

import grpc

from prorag.rpc.clients import PolicyClient
# The real policy + retriever stack of test_service (module-scoped, so this module starts its own), on each engine
# test_service runs (the vLLM case where `make test-vllm` built its environment).
from tests.services.policy.test_service import (adapters, engine, home, loop, model_dir, served_model,  # noqa: F401
                                                 stack)


def test_concurrent_activate_and_unload_never_leave_an_unloaded_adapter_active(stack):  # noqa: F811
    refused = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}  # the caller lost a race: fine
    unexpected: list[grpc.RpcError] = []
    generate_errors: list[grpc.RpcError] = []
    stop = threading.Event()

    def hammer(action):
        with PolicyClient(stack["target"]) as c:
            for _ in range(15):
                try:
                    action(c)
                except grpc.RpcError as e:
                    if e.code() not in refused:
                        unexpected.append(e)

    def activate_then_base(c):
        c.activate_adapter("pol", "v1")  # loads it when an unload got there first
        c.activate_adapter("", "")  # so that the next unload can succeed

    def generate_without_adapter():
        with PolicyClient(stack["target"]) as c:
            while not stop.is_set():
                try:
                    c.generate_steps(["Kest"], c.sampling(n=1, temperature=0.0, max_tokens=2))
                except grpc.RpcError as e:
                    generate_errors.append(e)

    hammers = [threading.Thread(target=hammer, args=(activate_then_base,)),
               threading.Thread(target=hammer, args=(lambda c: c.activate_adapter("pol", "v1"),)),
               threading.Thread(target=hammer, args=(lambda c: c.unload_adapter("pol", "v1"),)),
               threading.Thread(target=hammer, args=(lambda c: c.unload_adapter("pol", "v1"),))]
    client = threading.Thread(target=generate_without_adapter)
    client.start()
    for t in hammers:
        t.start()
    for t in hammers:
        t.join(120)
    stop.set()
    client.join(30)
    with PolicyClient(stack["target"]) as c:
        listed = c.list_adapters()
        loaded = {f"{a.ref.name}@{a.ref.version}" for a in listed.adapters}
        assert listed.active in loaded | {""}, (listed.active, loaded)
        # a request that names no adapter runs on the active one, which must still be there
        r = c.generate_steps(["Kest"], c.sampling(n=1, temperature=0.0, max_tokens=4))
        assert r.adapter_version == listed.active
        c.activate_adapter("", "")
    assert not generate_errors, [(e.code(), e.details()) for e in generate_errors[:3]]
    assert not unexpected, [(e.code(), e.details()) for e in unexpected]
