"""The first process of an agent's sandbox (standard library only; never imported by asyncrl itself).

``asyncrl.sandbox.agents`` starts it under bubblewrap as ``python -I -S -B -c <this source> <job as JSON>``::

    {"argv": ["python", "agent.py"], "cwd": "/work", "env": {...}, "socket": "/run/asyncrl/endpoint.sock",
     "port_env": ["OPENAI_BASE_URL", ...], "limits": {"memory_mb": 4096, "nproc": 128, "file_size_mb": 256}}

The sandbox has no network but its loopback, and an agent framework speaks HTTP over TCP: so this listens on
``127.0.0.1`` (a port the kernel picks), writes it into the ``port_env`` variables (``{port}`` in their
values) and carries each connection's bytes, both ways, to the Unix socket bound in from outside, where the
rollout's proxy (``asyncrl.sandbox.agents.EndpointProxy``) decides what reaches the sidecar. It holds nothing
the agent could not reach itself: the socket is in the agent's filesystem too, and every rule is enforced
outside.

Then it runs the agent under the rlimits and exits with its status (128 + the signal that killed it; 127 if
it cannot start). As the PID namespace's init, its exit ends whatever the agent left running.
"""

import json
import resource
import socket
import subprocess
import sys
import threading


def carry(src, dst):
    """``src``'s bytes to ``dst`` until ``src`` ends, then end ``dst``'s writing side (a half-close, as HTTP
    clients that send their request and wait for the reply expect)."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def relay(conn, path):
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(path)
    except OSError:
        conn.close()
        up.close()
        return
    back = threading.Thread(target=carry, args=(up, conn), daemon=True)
    back.start()
    carry(conn, up)
    back.join()
    conn.close()
    up.close()


def serve(listener, path):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=relay, args=(conn, path), daemon=True).start()


def limited(limits):
    def apply():
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def main():
    job = json.loads(sys.argv[1])
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    threading.Thread(target=serve, args=(listener, job["socket"]), daemon=True).start()
    env = dict(job["env"])
    for name in job["port_env"]:
        env[name] = env[name].replace("{port}", str(port))
    try:
        proc = subprocess.Popen(
            job["argv"], cwd=job["cwd"], env=env, stdin=subprocess.DEVNULL, preexec_fn=limited(job["limits"])
        )
    except OSError as e:
        print(f"the agent's command cannot start: {e}", file=sys.stderr)
        return 127
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
