"""The lab network of ``tests/netns.py`` itself: a cut drops silently, a heal restores, threads stay home."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.netns import NetLab, require

# Listens and never accepts: the kernel completes handshakes into the backlog, which is all a connect needs.
LISTENER = ("import socket, sys, time\n"
            "s = socket.socket(); s.bind((sys.argv[1], 5000)); s.listen(64)\n"
            "print('ready', flush=True); time.sleep(60)\n")


@pytest.fixture
def lab():
    require()
    lab = NetLab(["a", "b"])
    yield lab
    lab.close()


def test_a_cut_drops_silently_and_a_heal_restores(lab):
    home = os.readlink("/proc/thread-self/ns/net")
    listener = subprocess.Popen(lab.argv("b", [sys.executable, "-c", LISTENER, lab.ip["b"]]),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "ready"
        with lab.entered("a"):
            assert os.readlink("/proc/thread-self/ns/net") != home
            socket.create_connection((lab.ip["b"], 5000), timeout=2).close()
            lab.cut("a", "b")
            start = time.monotonic()
            # Silence, not a refusal: the connect runs into its own timeout.
            with pytest.raises(TimeoutError):
                socket.create_connection((lab.ip["b"], 5000), timeout=0.5)
            assert time.monotonic() - start >= 0.45
            lab.heal()
            socket.create_connection((lab.ip["b"], 5000), timeout=2).close()
    finally:
        listener.kill()
        listener.wait(10)
        listener.stdout.close()
    assert os.readlink("/proc/thread-self/ns/net") == home


def test_leaving_the_lab_waits_for_threads_started_inside(lab):
    """A thread inherits its starter's namespace; trio's thread cache would hand one started inside the lab to
    later tests, so leaving waits until such threads have ended."""
    with lab.entered("a"):
        inside = threading.Thread(target=time.sleep, args=(0.5,))
        inside.start()
    assert not inside.is_alive()
