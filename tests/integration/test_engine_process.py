"""The sidecar's engine process: it dies with the server, and the server dies (saying why) with it."""

from __future__ import annotations

import os
import signal
import sys
import threading

import httpx
import psutil
import pytest

from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import GenRequest
from asyncrl.inference.builtin.engine_process import EngineProcess, start_method
from asyncrl.utils.children import spawn, wait_healthy
from asyncrl.utils.process import free_port
from helpers.launch import MICRO_MODEL


def start_sidecar(micro_model, tmp_path):
    port = free_port()
    log = tmp_path / "inference.log"
    argv = [sys.executable, "-m", "asyncrl", "serve", f"model.name={micro_model}", f"inference.port={port}"]
    proc = spawn("inference", [*argv, *MICRO_MODEL], log)
    wait_healthy(proc, f"http://127.0.0.1:{port}", 120)
    children = psutil.Process(proc.popen.pid).children()  # the engine and multiprocessing's resource tracker
    (engine,) = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
    return proc, engine, children, f"http://127.0.0.1:{port}", log


def wait_gone(process: psutil.Process, timeout_s: float) -> bool:
    try:
        process.wait(timeout_s)
        return True
    except psutil.TimeoutExpired:
        return False


def test_a_dead_engine_stops_the_server_with_a_reason(micro_model, tmp_path):
    proc, engine, _, url, log = start_sidecar(micro_model, tmp_path)
    try:
        chat = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        # `asyncrl serve` runs one thread when it starts the engine: forked, the engine starts with the
        # server's imports (a spawned one would run python's `-c ... --multiprocessing-fork` command line)
        assert engine.cmdline() == psutil.Process(proc.popen.pid).cmdline()
        engine.kill()
        assert proc.popen.wait(20) == 1
        assert "the engine process died (killed by SIGKILL)" in log.read_text()
    finally:
        if proc.popen.poll() is None:
            proc.popen.kill()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_engine_does_not_outlive_its_server(micro_model, tmp_path, sig):
    proc, _, children, _, _ = start_sidecar(micro_model, tmp_path)
    os.kill(proc.popen.pid, sig)
    proc.popen.wait(30)
    left = [c.cmdline() for c in children if not wait_gone(c, 30)]
    assert not left, f"outlived their server: {left}"


def test_beside_running_threads_the_engine_is_spawned_and_serves(micro_model):
    """A process with threads running (an embedding, this test's) must not fork: the engine is spawned, and
    it generates, and it ends with its client."""
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait)
    busy.start()
    try:
        assert start_method() == "spawn"
        engine = EngineProcess(
            ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0, numerics="reproducible"
        )
    finally:
        stop.set()
        busy.join()
    try:
        assert "--multiprocessing-fork" in psutil.Process(engine.process.pid).cmdline()
        (choices,) = engine.generate([GenRequest([engine.tokenizer.eos_token_id], max_tokens=3, seed=0)])
        assert len(choices) == 1 and 1 <= len(choices[0].token_ids) <= 3
    finally:
        engine.close()
    assert not engine.process.is_alive()
