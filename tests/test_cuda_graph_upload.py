"""Decode graphs are uploaded to the device when captured (dovetail_cuda.graph_upload): the driver is called
with the graph's executable and the replay stream, a failure leaves the graph to upload at its first launch,
and on a GPU an uploaded graph replays what it captured."""

from __future__ import annotations

import pytest
import torch

from dovetail_cuda import graph_upload


class FakeGraph:
    def raw_cuda_graph_exec(self):
        return 0x5EED


class FakeStream:
    cuda_stream = 0xBEEF


class FakeDriverUpload:
    def __init__(self, code=0):
        self.code, self.calls = code, []

    def __call__(self, executable, stream):
        self.calls.append((executable.value, stream.value))
        return self.code


def test_upload_passes_the_executable_and_the_stream_to_the_driver(monkeypatch):
    driver = FakeDriverUpload()
    monkeypatch.setattr(graph_upload, "_upload", driver)
    assert graph_upload.upload(FakeGraph(), FakeStream()) is True
    assert driver.calls == [(0x5EED, 0xBEEF)]


def test_a_failed_upload_is_reported_and_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(graph_upload, "_upload", FakeDriverUpload(code=1))
    assert graph_upload.upload(FakeGraph(), FakeStream()) is False
    assert "cuGraphUpload failed with CUresult 1" in caplog.text


def test_without_the_driver_library_graphs_upload_at_their_first_launch(monkeypatch, caplog):
    monkeypatch.setattr(graph_upload, "_upload", None)
    monkeypatch.setattr(graph_upload.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(f"{name}: none")))
    assert graph_upload.upload(FakeGraph(), FakeStream()) is False
    assert "cuGraphUpload unavailable (libcuda.so.1: none)" in caplog.text
    assert graph_upload.upload(FakeGraph(), FakeStream()) is False  # the missing driver is looked for once
    assert caplog.text.count("unavailable") == 1


def test_a_torch_without_the_executable_handle_skips_the_upload(monkeypatch):
    driver = FakeDriverUpload()
    monkeypatch.setattr(graph_upload, "_upload", driver)
    assert graph_upload.upload(object(), FakeStream()) is False
    assert driver.calls == []


@pytest.mark.gpu
def test_the_platform_uploads_its_graphs_and_they_replay_what_they_captured(monkeypatch):
    from dovetail_cuda.platform import CudaPlatform

    uploaded = []
    real = graph_upload.upload
    monkeypatch.setattr(graph_upload, "upload", lambda graph, stream=None: uploaded.append(real(graph, stream)))
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)

    def step():
        for _ in range(8):  # several nodes, as a model's step has
            y.copy_(torch.sin(x) * 2 + 1)
        return y

    step()
    graph, out = CudaPlatform().capture_graph(step)
    assert uploaded == [True]
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, torch.sin(x) * 2 + 1)
