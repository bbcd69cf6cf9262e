"""Name the rank that is gone when a collective fails, so a killed rank does not end a run with a bare socket error.

When one rank dies (``kill -9``, out of memory, a lost node), the others fail in their next collective: gloo raises
``Connection reset by peer [10.0.0.2]:43121`` at once when the peer's sockets close, or the collective times out
(the strategy's ``timeout``) when its host vanished. Neither says which rank it was. This module keeps the little
state needed to say it, in the job's rendezvous store (the TCPStore at ``MASTER_ADDR:MASTER_PORT`` that the process
group was built on: rank 0's under Lightning's launcher, the agent's on node 0 under torchrun):

* :func:`start` (each rank, after the process group exists; world size > 1): writes this rank's host, pid and pid
  namespace, and starts a daemon thread that adds 1 to this rank's heartbeat counter every
  ``LP_WATCHDOG_INTERVAL`` seconds (default 1; ``LP_WATCHDOG=0`` turns all of this off): one store operation per
  rank and interval, nothing else.
* :func:`on_exception` (each rank, from the strategy's ``on_exception``: Lightning calls it for any exception in
  fit/validate/test/predict): records this rank's own exit (order and reason), then looks for the rank to blame:
  a peer on this machine whose process no longer exists (a pid look-up, same boot and pid namespace); a peer that
  stopped with an error before this rank did; or, when this rank's error looks like a failed collective, a peer
  whose heartbeat stopped (two reads ``max(2 s, 3 x interval)`` apart, polling the pids meanwhile; works across
  hosts). It prints one line, e.g.::

      lightning-parallel: rank 1 (pid 4242 on node-b) is gone (its process no longer exists): rank 0 got
      RuntimeError: [...] Connection reset by peer; this rank (0) stops

  and returns it; Lightning then tears down and re-raises, so the rank exits (non-zero) as it would have, with the
  culprit named. When the store itself is unreachable, its host is the one gone (rank 0, or torchrun's agent).
* :func:`stop` (the strategy's teardown): ends the heartbeat and marks this rank finished.

* :func:`enable_fault_handler` (every rank process the library's launchers start, and the test harness's ranks):
  a rank killed by a fatal signal (SIGSEGV in a C++ extension, a destructor or a backend thread) prints the Python
  stack of each of its threads to stderr before it dies, instead of leaving only the launcher's "terminated with
  signal SIGSEGV". Silent and free until such a signal.

* **Peer monitoring** (``LP_WATCHDOG_PEER_TIMEOUT=<seconds>``, off by default; ``scripts/launch/torchrun.sh
  --elastic`` turns it on at 15 s): the heartbeat thread also reads the heartbeat of one peer, the next rank
  (``(rank + 1) % world``: every rank is watched by one other, one store read per rank and interval). When that
  peer's count has not moved for the timeout and it has not said it stopped -- its host vanished or froze without
  closing its sockets, where a collective would wait for the whole collective timeout -- this rank prints which
  rank (and node) is gone and ends its own process at once (exit code :data:`PEER_LOST_EXIT_CODE`). Its closed
  sockets make every other rank's collective fail at once, so the whole broken world ends within seconds and an
  elastic agent (torchrun) restarts on the nodes that are left. A rendezvous store that stays unreachable for the
  timeout ends the rank the same way (its host, node 0 or torchrun's agent, is gone).

Ranks are named with their node when the launcher says it (torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``,
Lightning's ``NODE_RANK``): ``node 1 (ranks 2, 3: pids 4242, 4243 on node-b) is gone``.

Without peer monitoring it names ranks and shortens nothing: how long a rank waits for a peer that vanished without
closing its sockets is the collective timeout (``--trainer.strategy.init_args.timeout 0:05:00`` with a strategy
class path).
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["PEER_LOST_EXIT_CODE", "RankWatchdog", "active", "enable_fault_handler", "on_exception", "peer_timeout",
           "start", "stop"]

PEER_LOST_EXIT_CODE = 75
"""Exit code of a rank that ended itself because the peer it watches went silent (``EX_TEMPFAIL``: try again)."""

_PREFIX = "lightning_parallel/watchdog"
_STORE_TIMEOUT = timedelta(seconds=10)
_PEER_FAILURE_TEXT = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "timeout",
                      "nccl", "gloo", "pair.cc", "socket", "connection refused", "eof")


def _interval() -> float:
    try:
        return max(0.05, float(os.environ.get("LP_WATCHDOG_INTERVAL", "1")))
    except ValueError:
        return 1.0


def peer_timeout() -> float:
    """``LP_WATCHDOG_PEER_TIMEOUT`` in seconds; 0 (the default) = no peer monitoring."""
    try:
        return max(0.0, float(os.environ.get("LP_WATCHDOG_PEER_TIMEOUT", "0") or 0))
    except ValueError:
        return 0.0


def _node_from_env() -> int | None:
    """This process's node: torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``, Lightning's ``NODE_RANK``."""
    for key in ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def _enabled() -> bool:
    return os.environ.get("LP_WATCHDOG", "1").strip().lower() not in ("0", "false", "no", "off")


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text and text[0] else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _is_preemption(exc: BaseException) -> bool:
    """A stop every rank makes at the same point by itself: Lightning's ``SIGTERMException`` (a preemption), known by
    its name (this module imports no Lightning), or an error whose class says so (``every_rank_stops``: a non-finite
    loss, a checkpoint write that failed, both agreed on by every rank)."""
    if type(exc).__name__ == "SIGTERMException" or getattr(exc, "every_rank_stops", False):
        return True
    # a forked/spawned rank's error as its parent sees it (torch's ProcessRaisedException carries the traceback text)
    return type(exc).__name__ == "ProcessRaisedException" and any(
        name in str(exc) for name in ("SIGTERMException", "NonFiniteLossError", "CheckpointWriteError"))


def _looks_like_peer_failure(exc: BaseException) -> bool:
    """A failed collective or a launcher's signal, rather than this rank's own bug (which needs no waiting)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (dist.DistError, ConnectionError, TimeoutError)):
            return True
        if _is_preemption(current):  # after a launcher's SIGTERM
            return True
        text = str(current).lower()
        if isinstance(current, RuntimeError) and any(p in text for p in _PEER_FAILURE_TEXT):
            return True
        current = current.__cause__ or current.__context__
    return False


def _pid_namespace() -> str:
    """This machine's boot id and pid namespace: two ranks whose pids may be looked up from each other agree on it
    (a host name alone does not tell containers apart)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("?")
    return " ".join(parts)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie -- dead, not yet reaped by its parent -- counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


@dataclass
class _Peer:
    rank: int
    host: str | None = None
    pid: int | None = None
    namespace: str | None = None
    node: int | None = None
    exit_seq: int | None = None
    exit_reason: str | None = None
    why: str = ""
    verb: str = "is gone"

    def name(self) -> str:
        where = []
        if self.pid is not None:
            where.append(f"pid {self.pid}")
        if self.host:
            where.append(f"on {self.host}")
        text = " ".join(where)
        if self.node is not None:
            text += f"{', ' if text else ''}node {self.node}"
        return f"rank {self.rank}" + (f" ({text})" if text else "")


@dataclass
class RankWatchdog:
    """This rank's heartbeat in the rendezvous store and the look-up that names a lost peer (see the module)."""

    rank: int
    world_size: int
    store: Any
    prefix: str
    interval: float
    address: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    namespace: str = field(default_factory=_pid_namespace)
    root: _Peer | None = None
    store_error: BaseException | None = None
    exited: bool = False
    node: int | None = field(default_factory=_node_from_env)
    peer_timeout: float = 0.0
    """Seconds of silence of the watched peer after which this rank ends itself (0: no peer monitoring)."""
    on_peer_lost: Any = None
    """Called with the line naming the silent peer; default: print it and end this process
    (:data:`PEER_LOST_EXIT_CODE`)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _watch: tuple[int, float] | None = None
    _store_failing_since: float | None = None

    def key(self, *parts: object) -> str:
        return "/".join([self.prefix, *(str(p) for p in parts)])

    # ------------------------------------------------------------------ life cycle
    def begin(self) -> None:
        info = {"host": self.host, "pid": self.pid, "namespace": self.namespace, "node": self.node}
        self.store.set(self.key("info", self.rank), json.dumps(info))
        self.store.add(self.key("hb", self.rank), 1)
        self._thread = threading.Thread(target=self._beat, name="lightning-parallel-watchdog", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while True:
            try:
                if self.root is None and self.rank != 0:  # rank 0's pid, for when its store is gone with it
                    self.root = self._peer_info(0)
                if self._stop.wait(self.interval):
                    return
                self.store.add(self.key("hb", self.rank), 1)
                self.store_error, self._store_failing_since = None, None
                if self.peer_timeout > 0:
                    self._check_watched_peer()
            except Exception as err:  # the store's host is gone: on_exception reports it
                self.store_error = err
                if self.peer_timeout <= 0:
                    return  # stop quietly
                now = time.monotonic()
                self._store_failing_since = self._store_failing_since or now
                if now - self._store_failing_since >= self.peer_timeout and not self._stop.is_set():
                    self._peer_lost(self._store_gone_line(f"no answer from the store for {self.peer_timeout:.0f}s",
                                                          err, ending=True))
                    return

    # ------------------------------------------------------------------ peer monitoring
    @property
    def watched_rank(self) -> int:
        """The peer this rank watches: the next rank (every rank is watched by exactly one other)."""
        return (self.rank + 1) % self.world_size

    def _check_watched_peer(self) -> None:
        """One read of the watched peer's heartbeat; when it has not moved for :attr:`peer_timeout` seconds and the
        peer has not said it stopped, :meth:`_peer_lost`."""
        peer = self.watched_rank
        if peer == self.rank:
            return
        now = time.monotonic()
        if self._watch is None:
            if not self.store.check([self.key("info", peer)]):
                return  # not started yet: nothing to judge
            self._watch = (int(self.store.add(self.key("hb", peer), 0)), now)
            return
        count = int(self.store.add(self.key("hb", peer), 0))
        if count != self._watch[0]:
            self._watch = (count, now)
            return
        silent = now - self._watch[1]
        if silent < self.peer_timeout or self._exit_marker(peer) is not None or self._stop.is_set():
            return  # a peer that stopped by itself (finished or failed) is not lost: its exit ends its sockets
        info = self._peer_info(peer) or _Peer(peer)
        node = self._node_ranks(info.node)
        silence = f"no heartbeat for {silent:.0f}s; LP_WATCHDOG_PEER_TIMEOUT={self.peer_timeout:g}"
        if info.node is not None and info.node != self.node and len(node) > 1:
            host = f" on {info.host}" if info.host else ""
            pid = f", pid {info.pid}" if info.pid is not None else ""
            head = (f"node {info.node} (ranks {', '.join(str(r) for r in node)}{host}) is gone (rank {peer}{pid}: "
                    f"{silence})")
        else:
            head = f"{info.name()} is gone ({silence})"
        self._peer_lost(f"lightning-parallel: {head}: rank {self.rank} stops now so that the launcher restarts the "
                        "job on the nodes that are left")

    def _node_ranks(self, node: int | None) -> list[int]:
        """The ranks whose recorded node is ``node`` (from the store)."""
        if node is None:
            return []
        out = []
        for r in range(self.world_size):
            peer = self._peer_info(r) if r != self.rank else _Peer(r, node=self.node)
            if peer is not None and peer.node == node:
                out.append(r)
        return out

    def _peer_lost(self, line: str) -> None:
        if self.on_peer_lost is not None:
            self.on_peer_lost(line)
            return
        print(line, file=sys.stderr, flush=True)
        try:
            self._mark_exit(line.split(": ", 1)[-1][:200])
        except Exception:
            pass
        os._exit(PEER_LOST_EXIT_CODE)

    def _halt_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    def end(self) -> None:
        self._halt_heartbeat()
        if not self.exited and self.store_error is None:
            try:
                self._mark_exit("finished")
            except Exception:
                pass

    # ------------------------------------------------------------------ store reads
    def _peer_info(self, rank: int) -> _Peer | None:
        key = self.key("info", rank)
        if not self.store.check([key]):
            return None
        info = json.loads(self.store.get(key))
        node = info.get("node")
        return _Peer(rank, host=info.get("host"), pid=info.get("pid"), namespace=info.get("namespace"),
                     node=int(node) if isinstance(node, int) else None)

    def _mark_exit(self, reason: str) -> int:
        seq = int(self.store.add(self.key("exit_seq"), 1))
        self.store.set(self.key("exit", self.rank), json.dumps({"seq": seq, "reason": reason}))
        self.exited = True
        return seq

    def _exit_marker(self, rank: int) -> tuple[int, str] | None:
        key = self.key("exit", rank)
        if not self.store.check([key]):
            return None
        marker = json.loads(self.store.get(key))
        return int(marker["seq"]), str(marker["reason"])

    def _dead_here(self, peers: list[_Peer]) -> list[_Peer]:
        """Peers on this host whose process no longer exists (no waiting: a pid look-up)."""
        dead = [p for p in peers
                if p.namespace == self.namespace and p.pid is not None and not process_alive(p.pid)]
        for p in dead:
            p.why = "its process no longer exists" + (
                f"; it had stopped with {p.exit_reason}" if p.exit_reason and p.exit_reason != "finished" else "")
        return dead

    def _heartbeats(self, ranks: list[int]) -> dict[int, int]:
        return {r: int(self.store.add(self.key("hb", r), 0)) for r in ranks}  # add 0: read without blocking

    # ------------------------------------------------------------------ the diagnosis
    def diagnose(self, exception: BaseException) -> str | None:
        """The line naming the rank(s) to blame for ``exception`` on this rank, or None (this rank is the first to
        fail, or no peer could be blamed)."""
        own = _first_line(exception)
        if self.store_error is not None:  # the heartbeat already found the store gone: no more failing calls
            return self._store_gone_line(own, self.store_error)
        try:
            my_seq = self._mark_exit(own)  # first: peers now know this rank stopped by itself, not vanished
            self._halt_heartbeat()  # then one user of the store client at a time
            peers = [self._peer_info(r) or _Peer(r) for r in range(self.world_size) if r != self.rank]
            for peer in peers:
                marker = self._exit_marker(peer.rank)
                if marker is not None:
                    peer.exit_seq, peer.exit_reason = marker
            gone = self._dead_here(peers)
            if not gone:
                earlier = sorted((p for p in peers if p.exit_seq is not None and p.exit_seq < my_seq
                                  and p.exit_reason != "finished"), key=lambda p: p.exit_seq or 0)
                if earlier:
                    for p in earlier:
                        p.verb, p.why = "failed first", f"with {p.exit_reason}"
                    gone = earlier
            if not gone and _looks_like_peer_failure(exception):
                silent = [p for p in peers if p.exit_seq is None]
                wait = max(2.0, 3 * self.interval)
                before = self._heartbeats([p.rank for p in silent])
                deadline = time.monotonic() + wait
                while not gone and time.monotonic() < deadline:  # a peer on this host may still be exiting
                    time.sleep(0.2)
                    gone = self._dead_here(peers)
                after = {} if gone else self._heartbeats([p.rank for p in silent])
                for p in [] if gone else silent:
                    if after[p.rank] == before[p.rank] and self._exit_marker(p.rank) is None:
                        p.why = f"no heartbeat for {wait:.0f}s and no error reported"
                        gone.append(p)
        except Exception as err:  # the store is unreachable: its host went down
            self.store_error = err
            return self._store_gone_line(own, err)
        if not gone:
            return None
        nodes = {p.node for p in gone}
        lost_node = next(iter(nodes)) if len(nodes) == 1 and len(gone) > 1 else None
        if len(gone) == 1:
            head = f"{gone[0].name()} {gone[0].verb} ({gone[0].why})"
        elif lost_node is not None and lost_node != self.node and all(p.verb == "is gone" for p in gone):
            pids = ", ".join(str(p.pid) for p in gone if p.pid is not None)
            hosts = sorted({p.host for p in gone if p.host})
            head = (f"node {lost_node} (ranks {', '.join(str(p.rank) for p in gone)}"
                    f"{': pids ' + pids if pids else ''}{' on ' + ', '.join(hosts) if hosts else ''}) is gone "
                    f"({'; '.join(f'rank {p.rank}: {p.why}' for p in gone)})")
        else:
            verb = "failed first" if all(p.verb == "failed first" for p in gone) else "are gone"
            head = (f"ranks {', '.join(str(p.rank) for p in gone)} {verb} "
                    f"({'; '.join(f'{p.name()}: {p.why}' for p in gone)})")
        return f"lightning-parallel: {head}: rank {self.rank} got {own}; this rank ({self.rank}) stops"

    def _store_gone_line(self, own: str, err: BaseException, *, ending: bool = False) -> str:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            host = "torchrun's agent on node 0 (it hosts the store)"
        elif self.rank == 0:
            host = "the store's host"
        elif self.root is not None:
            host = f"{self.root.name()}, which hosts the store,"
        else:
            host = "rank 0, which hosts the store,"
        verb = f"rank {self.rank} had {own}; this rank stops now" if ending else (
            f"rank {self.rank} got {own}; this rank ({self.rank}) stops")
        return (f"lightning-parallel: {host} is gone (the rendezvous store at {self.address} is unreachable: "
                f"{_first_line(err, 120)}): {verb}")


_ACTIVE: RankWatchdog | None = None
_GENERATION = 0


def enable_fault_handler(*, replace: bool = True) -> bool:
    """On a fatal signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) print every thread's Python stack to this
    process's stderr (:mod:`faulthandler`); nothing is printed otherwise. ``replace=True`` (a rank the launcher
    started) re-installs it on this process's stderr: a forked rank inherits the parent's handler, which may write
    elsewhere or have been replaced by a library's. ``replace=False`` (the user's own process) keeps one already
    enabled. Returns whether a handler is enabled."""
    if not replace and faulthandler.is_enabled():
        return True
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is None:
                continue
            stream.fileno()  # pytest's capsys and some notebooks give a stream without a file descriptor
            if replace:
                faulthandler.disable()
            faulthandler.enable(file=stream, all_threads=True)
            return True
        except (AttributeError, OSError, ValueError):
            continue
    return faulthandler.is_enabled()


def _world_token() -> str:
    """A name every rank of this world shares and no earlier world used, for the keys in the store. Under torchrun
    the store outlives the worlds an elastic job goes through, and the restart count differs between agents (a node
    that joins later starts at 0), so rank 0 draws one and broadcasts it (a collective: every rank starts its
    watchdog at the same point of the set-up); other launchers start one world per store."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    import uuid

    box: list[Any] = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{box[0]}"


def active() -> RankWatchdog | None:
    """This process's running watchdog, if any."""
    return _ACTIVE


def start(*, rank: int, world_size: int) -> RankWatchdog | None:
    """Start this rank's heartbeat (idempotent; needs the process group and ``MASTER_ADDR``/``MASTER_PORT``).

    Returns None, and does nothing, for one rank, with ``LP_WATCHDOG=0``, or when the store cannot be reached."""
    global _ACTIVE, _GENERATION
    if _ACTIVE is not None:
        return _ACTIVE
    if world_size < 2 or not _enabled() or not (dist.is_available() and dist.is_initialized()):
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    _GENERATION += 1  # every rank starts (fit, then test, ...) as often as the others: the same keys everywhere
    prefix = f"{_PREFIX}/{_world_token()}/{_GENERATION}"
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False)
        watchdog = RankWatchdog(rank=rank, world_size=world_size, store=store, prefix=prefix, interval=_interval(),
                                address=f"{addr}:{port}", peer_timeout=peer_timeout())
        watchdog.begin()
    except Exception:  # no TCP store there (another rendezvous): run without
        return None
    _ACTIVE = watchdog
    return watchdog


def stop() -> None:
    """End this rank's heartbeat and mark it finished (the strategy's teardown)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.end()
        _ACTIVE = None


def on_exception(exception: BaseException) -> str | None:
    """Print (stderr) and return the line naming the lost rank for this rank's ``exception``, or None."""
    if _ACTIVE is None or isinstance(exception, KeyboardInterrupt) or _is_preemption(exception) or _ACTIVE.exited:
        return None  # an interrupt or a preemption stops every rank on purpose: nobody is to blame
    line = _ACTIVE.diagnose(exception)
    if line:
        print(line, file=sys.stderr, flush=True)
    return line


def _stopped_within(proc: Any, timeout: float) -> bool:
    """Whether ``proc`` -- a ``subprocess.Popen`` (the ``popen`` launcher) or a ``multiprocessing.Process`` (the
    ``spawn``/``fork`` launchers) -- has ended, waiting at most ``timeout`` seconds."""
    if callable(getattr(proc, "wait", None)):
        try:
            proc.wait(timeout=timeout)
            return True
        except Exception:  # subprocess.TimeoutExpired: still running (or frozen)
            return False
    proc.join(timeout)
    return not proc.is_alive()


def end_started_ranks(launcher: Any, exception: BaseException, *, grace: float = 5.0) -> list[int]:
    """On the process that started the other ranks (Lightning's launchers: ``popen`` in rank 0, ``spawn``/``fork``
    in the main process), after a rank failed: give them ``grace`` seconds to stop on their own, then SIGKILL the rest
    -- a frozen rank (stopped, deadlocked) would otherwise outlive the job. Not for a preemption stop, where every rank
    stops by itself. Returns the pids ended."""
    procs = list(getattr(launcher, "procs", None) or [])
    if not procs or isinstance(exception, KeyboardInterrupt) or _is_preemption(exception):
        return []
    deadline = time.monotonic() + grace
    ended = []
    for proc in procs:
        if not _stopped_within(proc, max(0.0, deadline - time.monotonic())):
            try:
                proc.kill()  # SIGKILL reaches a stopped process too
                _stopped_within(proc, 10)
            except Exception:
                pass
            ended.append(proc.pid)
    if ended:
        print(f"lightning-parallel: ended rank process(es) {ended} that had not stopped {grace:.0f} s after this "
              "rank failed", file=sys.stderr, flush=True)
    return ended
