"""The guest harness itself: commands, background jobs, networks, shares, boot failures."""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import pytest

from metaroce_harness.guests import (
    REPO_ROOT,
    Guest,
    GuestBootError,
    GuestCluster,
    GuestCommandError,
    GuestImage,
    GuestTimeoutError,
)

pytestmark = pytest.mark.e2e


def test_run_reports_output_exit_code_env_and_input(node1: Guest) -> None:
    r = node1.run("hostname; echo oops >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "node-1\n", "oops\n")
    assert not r.ok
    with pytest.raises(GuestCommandError, match="exit 3"):
        r.check()
    r = node1.run(["sh", "-c", 'echo "$GREETING"; cat'], env={"GREETING": "hi"}, input="in\n")
    assert r.stdout == "hi\nin\n"
    assert node1.run("uname -r", check=True).stdout.strip() == node1.kernel


def test_run_timeout_kills_the_command(node1: Guest) -> None:
    with pytest.raises(GuestTimeoutError, match="timed out") as exc:
        node1.run("echo started; sleep 60", timeout=1)
    assert exc.value.result is not None and exc.value.result.stdout == "started\n"
    assert node1.run("pgrep -x sleep || true").stdout == ""


def test_background_command_start_wait_and_kill(node1: Guest) -> None:
    quick = node1.start("sleep 0.2; echo done")
    assert quick.wait(timeout=30).stdout == "done\n"
    slow = node1.start(["sh", "-c", "echo up; exec sleep 600"])
    assert slow.poll() is None
    with pytest.raises(GuestTimeoutError):
        slow.wait(timeout=0.5)
    result = slow.kill(signal.SIGTERM)
    assert result.returncode == -signal.SIGTERM and result.stdout == "up\n"


def test_files_go_both_ways(node1: Guest) -> None:
    data = bytes(range(256)) * 4
    node1.write_file("/tmp/harness/blob", data, mode=0o600)
    assert node1.read_file("/tmp/harness/blob") == data
    assert node1.run("stat -c %a /tmp/harness/blob").stdout.strip() == "600"


def test_private_l2_joins_the_guests(guests: GuestCluster) -> None:
    a, b = guests[0], guests[1]
    before = guests.l2_counters()
    # the lossless link: taps on a kernel bridge (the tests run as root, as setup does)
    assert before.kind == "bridge", before
    r = a.run(f"ping -c 2 -W 5 {b.ip} && ip -br addr show eth0", check=True)
    assert "0% packet loss" in r.stdout and f"{a.ip}/24" in r.stdout
    assert b.run(f"getent hosts {a.name}", check=True).stdout.split()[0] == a.ip
    # 1,000 large echo requests as fast as the replies come back (a flood ping)
    b.run(f"ping -f -q -c 1000 -s 1400 {a.ip}", timeout=120)
    after = guests.l2_counters()
    print(f"{after.describe()} (before: {before.describe()})")
    assert after.frames >= before.frames + 2000, (before, after)
    assert after.dropped == before.dropped, f"the lossless L2 dropped frames: {before} -> {after}"


def test_guest_reaches_host_loopback_at_10_0_2_2(node1: Guest) -> None:
    """qemu user networking: a service on the host's 127.0.0.1 answers at 10.0.2.2."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        token = os.urandom(8).hex()

        def serve() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(token.encode())

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        r = node1.run_python(
            "import socket, sys; s = socket.create_connection(('10.0.2.2', int(sys.argv[1])), "
            "timeout=20); print(s.recv(100).decode())",
            str(port),
            timeout=60,
            check=True,
        )
        t.join(timeout=10)
    assert r.stdout.strip() == token


def test_repo_and_guest_python_are_shared(node1: Guest) -> None:
    path = node1.guest_path(REPO_ROOT / "pyproject.toml")
    assert node1.run(["cat", path], check=True).stdout == (REPO_ROOT / "pyproject.toml").read_text()
    r = node1.run_python(
        "import yaml, pyverbs, metaroce_harness; print(yaml.safe_dump({'ok': 1}).strip())",
        timeout=120,
        check=True,
    )
    assert r.stdout.strip() == "ok: 1"
    assert node1.run("touch /share/x", timeout=30).returncode != 0, "the share must be read-only"


def test_root_is_a_writable_overlay_that_stays_in_the_guest(
    node1: Guest, guest_image: GuestImage
) -> None:
    r = node1.run("findmnt -no FSTYPE /; echo hi > /usr/local/probe && cat /usr/local/probe")
    assert r.stdout.split() == ["overlay", "hi"], r.describe()
    assert not (guest_image.rootfs / "usr" / "local" / "probe").exists(), "a write reached the host"


def _assert_cleaned_up(cluster: GuestCluster) -> None:
    assert cluster.run_dir is not None and not cluster.run_dir.exists()
    for g in cluster:
        assert g.proc is not None and g.proc.poll() is not None, f"{g.name}: qemu still runs"
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode("utf-8", "replace")
            except OSError:
                continue
            assert str(cluster.run_dir) not in cmdline, f"pid {proc.name} survived"


def test_hung_boot_is_retried_then_reported_and_cleaned_up(guest_image: GuestImage) -> None:
    """A guest that does not come up in time is killed and booted once more; then the
    error names the console log, and nothing is left behind."""
    cluster = GuestCluster(count=1, image=guest_image, boot_timeout=1.0, boot_attempts=2)
    with pytest.raises(GuestBootError, match="boot watchdog") as exc:
        cluster.start()
    g = cluster[0]
    assert g.attempts == 2
    assert str(g.console_log) in str(exc.value)
    assert g.console_log.with_suffix(".attempt1.log").exists()
    _assert_cleaned_up(cluster)


def test_a_guest_whose_clock_runs_fast_is_booted_again_then_reported(
    guest_image: GuestImage,
) -> None:
    """The failure a busy host gave CI once (a TSC calibrated at a 14th-18th of its rate,
    kept because `tsc=reliable` turns the watchdog off), forced here by telling the
    kernel that rate: the guest is booted again, then refused with its kernel's words."""
    cluster = GuestCluster(
        count=1, image=guest_image, share=None, kernel_args="tsc_early_khz=135000"
    )
    with pytest.raises(GuestBootError, match="guest clock runs fast") as exc:
        cluster.start()
    assert cluster[0].attempts == 2
    assert "tsc: Detected 135.000 MHz processor" in str(exc.value)
    _assert_cleaned_up(cluster)


def test_qemu_failure_is_reported_with_its_log(guest_image: GuestImage, tmp_path: Path) -> None:
    bad_kernel = tmp_path / "vmlinux"
    bad_kernel.write_bytes(b"not a kernel")
    image = GuestImage(
        root=guest_image.root,
        vmlinux=bad_kernel,
        initramfs=guest_image.initramfs,
        guest_python=guest_image.guest_python,
        kernel_release=guest_image.kernel_release,
        rootfs=guest_image.rootfs,
    )
    cluster = GuestCluster(count=1, image=image, boot_timeout=30, boot_attempts=2)
    with pytest.raises(GuestBootError, match="qemu exited") as exc:
        cluster.start()
    assert str(cluster[0].qemu_log) in str(exc.value)
    assert "kernel" in cluster[0].qemu_log.read_text()
    _assert_cleaned_up(cluster)
