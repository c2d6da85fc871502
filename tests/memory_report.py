"""The suite's memory, measured while it runs: a pytest plugin of the main process (the xdist controller).

A thread reads, every `INTERVAL` seconds, the anonymous resident memory (RssAnon + RssShmem of /proc/PID/status:
what only swap or the OOM killer can take back; TensorFlow's shared library pages are left out, as they are shared
and reclaimable) of the pytest process and every process below it (xdist workers, the servers and benchmark runs
they start, notebook kernels), and the machine's used memory (MemTotal - MemAvailable). Both reads are cheap: no
page-table walk (smaps) that would stall a worker's allocations. The terminal summary gives both peaks, the tests
running at the tree's peak, how it splits by process (each xdist worker with what it started), and the tests
during which the tree was largest: the ones to share models in, free after, or run alone. Linux only (it reads
/proc); elsewhere it says nothing. Numbers, not a target: memory targets live in benchmarks/.
"""

import os
import threading
import time

INTERVAL = 1.0
GIB = 2**30
SHOWN = 8  # tests listed by their peak


def _children():
    """`{ppid: [pid, ...]}` of every process on the machine."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    return children


def _anonymous(pid):
    """Bytes of `pid`'s RssAnon + RssShmem; 0 if it is gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def tree_bytes(root, children=None):
    """Anonymous resident memory of `root` and all its descendants, in bytes."""
    children, total, stack = children or _children(), 0, [root]
    while stack:
        pid = stack.pop()
        total += _anonymous(pid)
        stack += children.get(pid, [])
    return total


def _name(pid):
    """A short name of `pid`: `worker PID` for an xdist worker (execnet starts it as `python -u -c CODE`), else
    its command line's first words."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = [word.decode(errors="replace") for word in f.read().split(b"\0")]
    except OSError:
        return str(pid)
    return f"worker {pid}" if words[1:3] == ["-u", "-c"] else " ".join(words[:3])[:60]


def breakdown(root, children):
    """`[(name, bytes)]`: `root`'s own anonymous memory, then each child's with everything below it."""
    return [("pytest", _anonymous(root))] + [(_name(pid), tree_bytes(pid, children)) for pid in children.get(root, [])]


def used_bytes():
    """The machine's MemTotal - MemAvailable, in bytes."""
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return fields["MemTotal"] - fields["MemAvailable"]


class MemoryReport:
    def __init__(self):
        self.running = {}  # nodeid -> None, in start order
        self.per_test = {}  # nodeid -> the tree's peak while it ran
        self.peak = (0, [], [])  # (bytes, tests running then, [(process, bytes)])
        self.peak_used = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = None
        self.start = time.monotonic()
        self.workers = {}  # xdist worker id ("gw0") or "main" -> [seconds busy in tests, when its last test ended]

    def pytest_sessionstart(self, session):
        if not os.path.isdir("/proc/self"):
            return
        self.thread = threading.Thread(target=self._sample, name="memory-report", daemon=True)
        self.thread.start()

    def _sample(self):
        root = os.getpid()
        while not self.stop.wait(INTERVAL):
            children = _children()
            size, used = tree_bytes(root, children), used_bytes()
            new_peak = size > self.peak[0]
            parts = breakdown(root, children) if new_peak else None  # where the memory is, at a new peak only
            with self.lock:
                self.peak_used = max(self.peak_used, used)
                if new_peak:
                    self.peak = (size, list(self.running), parts)
                for nodeid in self.running:
                    self.per_test[nodeid] = max(self.per_test.get(nodeid, 0), size)

    def pytest_runtest_logstart(self, nodeid, location):
        with self.lock:
            self.running[nodeid] = None

    def pytest_runtest_logfinish(self, nodeid, location):
        with self.lock:
            self.running.pop(nodeid, None)

    def pytest_runtest_logreport(self, report):
        gateway = getattr(getattr(report, "node", None), "gateway", None)
        with self.lock:
            worker = self.workers.setdefault(getattr(gateway, "id", "main"), [0.0, 0.0])
            worker[0] += getattr(report, "duration", 0.0) or 0.0
            worker[1] = time.monotonic() - self.start
        if report.when == "???":  # xdist's report of a test whose worker died: no logfinish follows
            self.pytest_runtest_logfinish(report.nodeid, report.location)

    def pytest_terminal_summary(self, terminalreporter):
        if self.thread is None:
            return
        self.stop.set()
        self.thread.join()
        size, running, parts = self.peak
        write = terminalreporter.write_line
        terminalreporter.section("memory")
        write(f"peak anonymous memory of pytest and the processes below it: {size / GIB:.2f} GiB; machine's used "
              f"memory at its peak: {self.peak_used / GIB:.2f} GiB (MemTotal - MemAvailable; every {INTERVAL:g} s)")
        write("running at the peak: " + (", ".join(running) or "none"))
        write("by process at the peak: " + ", ".join(f"{name} {part / GIB:.2f} GiB" for name, part in parts or []))
        largest = sorted(self.per_test.items(), key=lambda item: -item[1])[:SHOWN]
        for nodeid, peak in largest:
            write(f"  {peak / GIB:6.2f} GiB  {nodeid}")
        # Where a run loses time to one worker idling while the other still works (a long test handed out last).
        terminalreporter.section("workers")
        write(f"session {time.monotonic() - self.start:.0f} s; " + "; ".join(
            f"{name}: {busy:.0f} s in tests, its last one ended at {ended:.0f} s"
            for name, (busy, ended) in sorted(self.workers.items())))
