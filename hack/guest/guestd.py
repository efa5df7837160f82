#!/usr/bin/python3
"""Command server of the MetaRoCE test guest (baked into the image, started by /init).

Runs as PID 1: the first process only reaps orphans and restarts the server if it dies;
a forked child serves requests on the virtio-serial port named ``org.metaroce.cmd``.

Protocol: JSON objects, one per line, both ways. The host sends requests
``{"id": N, "op": "...", ...}`` and gets one reply ``{"id": N, "ok": true|false, ...}``
per request (requests are served concurrently, replies may come in any order). Whenever
the host (re)connects the guest sends ``{"event": "ready", ...}``.

Ops:
  ping                                   -> uptime
  run    cmd, timeout, env, cwd, input   -> rc, stdout, stderr, timed_out, duration
  start  cmd, env, cwd, input            -> handle, pid         (background command)
  wait   handle, timeout                 -> running, rc, stdout, stderr, duration
  kill   handle, signal, timeout         -> like wait (the whole process group gets it)
  read_file  path                        -> data (base64)
  write_file path, data (base64), mode   -> nothing

A command is ``bash -c`` of a string, or an argv list. Its stdout and stderr go to files,
so ``run`` returns when the command's own process exits even if it left children behind
(they keep running). On timeout the whole process group is killed with SIGKILL.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

PORT_NAME = "org.metaroce.cmd"
STATE = "/run/metaroce"
OUT_DIR = STATE + "/cmd"


def log(msg: str) -> None:
    try:
        with open("/proc/uptime") as f:
            up = f.read().split()[0]
        with open("/dev/console", "w") as con:
            con.write(f"guestd [{up}]: {msg}\n")
    except OSError:
        print(f"guestd: {msg}", file=sys.stderr)


def base_env() -> dict[str, str]:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    try:
        with open(STATE + "/env") as f:
            for line in f:
                name, sep, value = line.rstrip("\n").partition("=")
                if sep and name:
                    env[name] = value
    except OSError:
        pass
    return env


class Job:
    def __init__(self, handle: int, req: dict[str, Any]) -> None:
        self.handle = handle
        self.out = f"{OUT_DIR}/{handle}.out"
        self.err = f"{OUT_DIR}/{handle}.err"
        cmd = req["cmd"]
        argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        env = base_env()
        env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
        stdin: Any = subprocess.DEVNULL
        if req.get("input") is not None:
            path = f"{OUT_DIR}/{handle}.in"
            with open(path, "w") as f:
                f.write(req["input"])
            stdin = open(path)  # noqa: SIM115 - closed right after Popen
            os.unlink(path)
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.started = time.monotonic()
            try:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=stdin,
                    stdout=out,
                    stderr=err,
                    env=env,
                    cwd=req.get("cwd") or "/",
                    start_new_session=True,
                )
            finally:
                if stdin is not subprocess.DEVNULL:
                    stdin.close()
        self.finished: float | None = None

    def wait(self, timeout: float | None) -> bool:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        if self.finished is None:
            self.finished = time.monotonic()
        return True

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def output(self) -> tuple[str, str]:
        def read(path: str) -> str:
            try:
                with open(path, "rb") as f:
                    return f.read().decode("utf-8", "replace")
            except OSError:
                return ""

        return read(self.out), read(self.err)

    def result(self, timed_out: bool = False) -> dict[str, Any]:
        stdout, stderr = self.output()
        running = self.proc.poll() is None
        end = self.finished if self.finished is not None else time.monotonic()
        return {
            "running": running,
            "rc": None if running else self.proc.returncode,
            "stdout": stdout,
            "stderr": stderr,
            "timed_out": timed_out,
            "duration": end - self.started,
        }

    def remove_files(self) -> None:
        for path in (self.out, self.err):
            with contextlib.suppress(OSError):
                os.unlink(path)


class Server:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.write_lock = threading.Lock()
        self.jobs: dict[int, Job] = {}
        self.jobs_lock = threading.Lock()
        self.next_handle = 1

    def send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self.write_lock:
            while data:
                try:
                    n = os.write(self.fd, data)
                except BlockingIOError:
                    time.sleep(0.01)
                    continue
                except OSError as exc:  # host went away: the reply is lost
                    log(f"write failed: {exc}")
                    return
                data = data[n:]

    def new_job(self, req: dict[str, Any]) -> Job:
        with self.jobs_lock:
            handle = self.next_handle
            self.next_handle += 1
        job = Job(handle, req)
        with self.jobs_lock:
            self.jobs[handle] = job
        return job

    def job(self, req: dict[str, Any]) -> Job:
        with self.jobs_lock:
            job = self.jobs.get(int(req["handle"]))
        if job is None:
            raise KeyError(f"no background command with handle {req['handle']}")
        return job

    def handle(self, req: dict[str, Any]) -> None:
        rid = req.get("id")
        try:
            reply = self.dispatch(req)
            reply.update(id=rid, ok=True)
        except Exception as exc:
            reply = {"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self.send(reply)

    def dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "ping":
            with open("/proc/uptime") as f:
                return {"uptime": float(f.read().split()[0])}
        if op == "run":
            job = self.new_job(req)
            timeout = req.get("timeout")
            done = job.wait(timeout)
            if not done:
                job.signal(signal.SIGKILL)
                job.wait(10)
            result = job.result(timed_out=not done)
            job.remove_files()
            with self.jobs_lock:
                self.jobs.pop(job.handle, None)
            return result
        if op == "start":
            job = self.new_job(req)
            return {"handle": job.handle, "pid": job.proc.pid}
        if op == "wait":
            job = self.job(req)
            job.wait(req.get("timeout"))
            return job.result()
        if op == "kill":
            job = self.job(req)
            job.signal(int(req.get("signal") or signal.SIGTERM))
            if not job.wait(req.get("timeout", 10)):
                job.signal(signal.SIGKILL)
                job.wait(10)
            return job.result()
        if op == "read_file":
            with open(req["path"], "rb") as f:
                return {"data": base64.b64encode(f.read()).decode()}
        if op == "write_file":
            path = req["path"]
            os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(req["data"]))
            os.chmod(path, int(req.get("mode", 0o644)))
            return {}
        raise ValueError(f"unknown op {op!r}")

    def ready_event(self) -> dict[str, Any]:
        try:
            with open(STATE + "/init-errors") as f:
                errors = [line.strip() for line in f if line.strip()]
        except OSError:
            errors = []
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return {
            "event": "ready",
            "hostname": os.uname().nodename,
            "kernel": os.uname().release,
            "init_errors": errors,
            "uptime": uptime,
        }

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN | select.POLLHUP)
        connected = False
        buf = b""
        while True:
            events = poller.poll(200)
            hup = any(ev & select.POLLHUP for _, ev in events)
            if hup:
                if connected:
                    log("host disconnected")
                connected = False
                buf = b""
                time.sleep(0.1)
                continue
            if not connected:
                connected = True
                self.send(self.ready_event())
            if not any(ev & select.POLLIN for _, ev in events):
                continue
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                time.sleep(0.05)
                continue
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                try:
                    req = json.loads(line)
                except ValueError:
                    log(f"bad request line: {line[:200]!r}")
                    continue
                threading.Thread(target=self.handle, args=(req,), daemon=True).start()


def find_port() -> str:
    base = "/sys/class/virtio-ports"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            for port in os.listdir(base):
                try:
                    with open(f"{base}/{port}/name") as f:
                        if f.read().strip() == PORT_NAME:
                            return f"/dev/{port}"
                except OSError:
                    continue
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"guestd: no virtio-serial port named {PORT_NAME}")


def serve() -> None:
    os.makedirs(OUT_DIR, exist_ok=True)
    path = find_port()
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    log(f"serving on {path}")
    Server(fd).serve()


def pid1() -> None:
    """Stay PID 1: reap every orphan, restart the server if it dies."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = -1
    while True:
        if server < 0:
            server = os.fork()
            if server == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                try:
                    serve()
                finally:
                    os._exit(1)
            log(f"server pid {server}")
        try:
            pid, status = os.wait()
        except ChildProcessError:
            time.sleep(1)
            continue
        if pid == server:
            log(f"server exited with status {status}; restarting")
            server = -1
            time.sleep(1)


if __name__ == "__main__":
    if os.getpid() == 1:
        pid1()
    else:
        serve()
