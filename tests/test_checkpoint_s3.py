"""Checkpoints in object storage (moto's S3 server, tests/test_streaming.py's fixture): the run's checkpoint
directory is s3://my-bucket/run/checkpoints and its logs stay local. The writer SIGKILLed while last.ckpt is
uploading leaves the previous one readable, and the starting command re-run on a machine without the run's local
directory continues from the bucket and ends bit-identical to an undisturbed run."""

import os
import re
import shutil
import signal
import socket
import sys
import threading

import pytest
import torch
import yaml

from project.checkpoint import read_checkpoint
from project.checkpoint_io import AtomicCheckpointIO
from tests.conftest import CONFIGS, run_cli
from tests.ddp_processes import env_for_children, start
from tests.test_resume import FLAGS
from tests.test_streaming import s3  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow
URL = "s3://my-bucket/run/checkpoints"


class CutUpload:
    """A TCP proxy in front of moto that passes everything, except that of the `nth` PUT of a last.ckpt it passes
    the headers and half the body, then nothing more: that upload is in flight (`cut` set) until the test kills
    the writer and `close()` drops the connections, as a lost machine would."""

    def __init__(self, endpoint: str, nth: int) -> None:
        self.upstream = ("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
        self.nth, self.puts, self.cut, self.sockets = nth, 0, threading.Event(), []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self.sockets += [client, upstream]
            threading.Thread(target=self.pump, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self.requests, args=(client, upstream), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def requests(self, client: socket.socket, upstream: socket.socket) -> None:
        pending, start = b"", None
        try:
            while data := client.recv(1 << 16):
                pending += data
                if start is None:
                    if re.search(
                        rb"PUT \S*/last\.ckpt\S* HTTP/1\.1\r\n", pending
                    ):  # a request line: one recv
                        self.puts += 1
                        if self.puts == self.nth:
                            start = pending.index(b"PUT ")
                    if start is None:
                        upstream.sendall(pending)
                        pending = b""
                        continue
                head_end = pending.find(b"\r\n\r\n", start)
                if head_end >= 0:
                    length = int(re.search(rb"(?i)content-length: *(\d+)", pending[start:head_end])[1])
                    if len(pending) >= head_end + 4 + length // 2:
                        upstream.sendall(pending[: head_end + 4 + length // 2])
                        self.cut.set()
                        return
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()
        for s in self.sockets:
            s.close()


@pytest.mark.claim("checkpoints-in-object-storage")
def test_checkpoints_in_s3_resume_bit_identical(s3, in_tmp, monkeypatch):  # noqa: F811
    for name, value in {**s3, "AWS_ALLOW_HTTP": "true"}.items():  # obstore reaches moto's http://
        monkeypatch.setenv(name, value)
    config = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    (keep,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RunCheckpoint")]
    keep["init_args"]["dirpath"] = URL
    (in_tmp / "s3.yaml").write_text(
        yaml.safe_dump({"trainer": {"callbacks": config["trainer"]["callbacks"]}})
    )
    overlay = ("--config", CONFIGS / "default.yaml", "--config", in_tmp / "s3.yaml")

    assert run_cli("fit", *FLAGS, "--run_dir", "runs/ref") == 0
    # The writer, reaching the bucket through CutUpload, is SIGKILLed while its 4th last.ckpt is half uploaded.
    proxy = CutUpload(s3["AWS_ENDPOINT_URL"], nth=4)
    env = {**env_for_children(), **s3, "AWS_ALLOW_HTTP": "true", "AWS_ENDPOINT_URL": proxy.endpoint}
    cmd = [sys.executable, "-m", "project", "fit", *overlay, *FLAGS, "--run_dir", "runs/a"]
    writer = start(cmd, in_tmp, env)
    try:
        assert proxy.cut.wait(timeout=150), writer.communicate(timeout=30)
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.communicate()
        proxy.close()
    assert read_checkpoint(f"{URL}/last.ckpt")["global_step"] >= 1  # the previous one, whole
    assert not (in_tmp / "runs/a/checkpoints").exists()
    # Another machine (no local run directory) continues the run with the starting command, from the bucket.
    shutil.rmtree(in_tmp / "runs/a")
    assert run_cli("fit", *overlay, *FLAGS, "--run_dir", "runs/a") == 0
    assert "s3://" in (in_tmp / "runs/a/resumes.jsonl").read_text()
    ours, ref = (
        read_checkpoint(f"{URL}/last.ckpt"),
        read_checkpoint(in_tmp / "runs/ref/checkpoints/last.ckpt"),
    )
    assert ours["global_step"] == ref["global_step"] == 12
    assert all(torch.equal(ours["state_dict"][k], v) for k, v in ref["state_dict"].items())
    assert (in_tmp / "runs/a/config.yaml").is_file() and not (in_tmp / "runs/a/checkpoints").exists()
    # A checkpoint that fails to serialise never reaches the bucket: the object there stays the previous one.
    with pytest.raises(Exception):  # noqa: B017 - pickle's error for a lambda
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "code": lambda: 0}, f"{URL}/last.ckpt")
    assert read_checkpoint(f"{URL}/last.ckpt")["global_step"] == 12
