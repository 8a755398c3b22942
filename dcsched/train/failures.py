"""Failure detection for multi-rank training: one clear line naming the failed rank, never a silent hang.

Each rank of ``dcsched train`` runs a :class:`Watch`: a daemon thread that,
every ``interval`` seconds, bumps this rank's heartbeat counter in the c10d
store and reads every peer's. A peer has failed when

* it posted a failure (a rank whose script raises or exits non-zero posts
  ``raised: <error>`` before it exits), or
* its heartbeat has not changed for ``timeout`` seconds (it died, e.g. SIGKILL,
  or hangs without the GIL), or
* the store itself stopped answering (its host is gone), or
* its main thread stopped making progress: each heartbeat carries the count of
  ZeRO-3 collectives the rank has issued, and a peer whose count has not moved
  for ``timeout`` seconds while this rank waits as long in a later collective
  (or has finished) is stuck (an endless loop, a deadlock outside dcsched),
  though its heartbeat thread beats on. A rank whose own collective timed out
  checks this first (with half the timeout), so it names the stuck peer, not
  itself.

The watch then prints ``dcsched train: rank 1 failed: no heartbeat for 3.0 s``
on stderr and ends the process with exit code 1 (``os._exit``: the main thread
may be blocked inside a collective that would otherwise wait for the dead
peer). Failures are numbered in the order they are posted; a rank whose own
error follows a peer's failure (a collective that broke because the peer died)
names the peer, not itself: before reporting its own error it waits until
every peer is either seen alive after the failure or judged failed.

A rank sent SIGTERM (torchrun's agent stopping its workers, a cluster
scheduler pre-empting the job) posts ``terminated by SIGTERM`` and exits with
code 143 at once, even while its main thread is blocked in a collective: the
signal's arrival is read from a wakeup pipe by a thread of its own, so its
peers name it within a heartbeat instead of after the timeout.

At the end, every rank posts ``done`` and waits for the others, so a rank that
finishes first neither reports its finished peers as dead nor takes the store
away from them. :meth:`Watch.meet` lines the ranks up after each compile, so
the process-group timeout measures communication, not compile-time skew.

Keys live under ``dcsched_train/`` in the store given (the default process
group's rendezvous store).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

#: Prefix of this module's keys in the c10d store.
PREFIX = "dcsched_train/"


class Watch:
    """Heartbeats and failure detection for ``rank`` of ``world_size`` over a c10d ``store``."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, interval_s: float | None = None,
                 exit: Callable[[str], None] | None = None, progress: Callable[[], int] | None = None) -> None:
        import torch.distributed as dist
        self.store = dist.PrefixStore(PREFIX, store)
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval_s = interval_s if interval_s is not None else min(1.0, self.timeout_s / 4)
        self.exit = exit or _exit_with
        self.peers = [r for r in range(world_size) if r != rank]
        now = time.monotonic()
        self.last_beat: dict[int, str | None] = {r: None for r in self.peers}
        self.seen_at: dict[int, float] = {r: now for r in self.peers}
        #: This rank's progress: the ZeRO-3 collectives it has issued (see the module docstring).
        if progress is None:
            from dcsched.runtime.distributed import collectives_issued
            progress = collectives_issued
        self.progress: Callable[[], int] = progress
        self.peer_progress: dict[int, tuple[int, float]] = {r: (-1, now) for r in self.peers}  # (count, since)
        self.own_progress: tuple[int, float] = (-1, now)
        self.finishing = False
        self.done: set[int] = set()
        self.own_failure: int | None = None  # the sequence number of this rank's posted failure
        self._beats = 0
        self._store_error_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dcsched-train-watch", daemon=True)

    # -- life cycle --------------------------------------------------------
    def start(self) -> "Watch":
        self._beat()
        self._thread.start()
        self._watch_sigterm()
        return self

    def _watch_sigterm(self) -> None:
        """Post SIGTERM as this rank's failure and exit 143 when it arrives (see the module docstring).

        Python runs a signal handler only when the main thread next runs
        Python code, which a blocked collective may never let it do; the C
        handler's write to the wakeup pipe happens at once. Installed only from
        the main thread, over the default SIGTERM action and an unused wakeup fd.
        """
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        if signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False) != -1:  # someone else's (an event loop)
            signal.set_wakeup_fd(-1)
            return
        signal.signal(signal.SIGTERM, lambda *_: None)  # the thread below acts; the main thread goes on
        threading.Thread(target=self._on_sigterm, args=(read_fd,), name="dcsched-train-sigterm",
                         daemon=True).start()

    def _on_sigterm(self, read_fd: int) -> None:
        while signal.SIGTERM not in os.read(read_fd, 64):
            pass
        try:
            self._post("terminated by SIGTERM")
        except Exception:  # the store is gone: the peers find out by the missing heartbeat
            pass
        # Under torchrun the usual sender is its agent stopping the other workers after one failed: say so, so
        # that this line is not read as the cause (the failed worker's own line is).
        _exit_with(f"dcsched train: rank {self.rank} terminated by SIGTERM (torchrun stops every worker once one "
                   "fails, or the job was cancelled)", 128 + signal.SIGTERM)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def finish(self) -> None:
        """The script ended well here: post ``done`` and wait until every peer is done, fails, or stops making
        progress for the timeout (a peer stuck after its last step would otherwise keep this rank forever)."""
        self.finishing = True
        self.store.set(f"done/{self.rank}", "1")
        while not self._stop.is_set() and len(self.done) < len(self.peers):
            time.sleep(self.interval_s / 2)
        self.stop()

    def failed(self, message: str) -> None:
        """This rank failed (``message``): post it, then wait until the peers' states say whose failure it was.

        Returns when every peer was seen alive after the post (the failure is
        this rank's own: the caller reports it); the watch thread ends the
        process first where a peer failed earlier or has died.
        """
        try:
            stuck = self._stuck_peer(time.monotonic(), self.timeout_s / 2)
            if stuck is not None:  # this rank's collective failed because a peer never joined it
                self._post_stopping(stuck)
                self.exit(f"dcsched train: {stuck}")
                return
            self.own_failure = self._post(message)
            before = {peer: self._read_beat(peer) for peer in self.peers}
            deadline = time.monotonic() + self.timeout_s + 3 * self.interval_s
            while time.monotonic() < deadline and self._thread.is_alive():
                # A beat written after the post: that peer is alive, so this failure is this rank's own.
                if all(peer in self.done or self._read_beat(peer) != before[peer] or self._failed_after(peer)
                       for peer in self.peers):
                    break
                time.sleep(self.interval_s / 2)
        except Exception:  # the store is gone too: nothing more to learn from it
            pass
        self.stop()

    def meet(self, name: str) -> None:
        """Wait until every rank got here under ``name`` (the same point in the same script); failures still end it."""
        key = f"meet/{name}"
        self.store.add(key, 1)
        while not self._stop.is_set() and int(self.store.add(key, 0)) < self.world_size:
            time.sleep(min(self.interval_s / 2, 0.05))

    # -- the watch thread --------------------------------------------------
    def _post(self, message: str) -> int:
        """Post ``message`` as this rank's failure, numbered in the order failures are posted; the number."""
        seq = int(self.store.add("failures", 1))
        self.store.set(f"failed/{self.rank}", f"{seq}|{message}")
        return seq

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"beat/{self.rank}", f"{self._beats}|{self.progress()}")

    def _note_progress(self, now: float) -> None:
        """When this rank's and each peer's progress count last changed."""
        own = self.progress()
        if own != self.own_progress[0]:
            self.own_progress = (own, now)
        for peer in self.peers:
            beat = self._read_beat(peer)
            count = int(beat.partition("|")[2] or -1) if beat else -1
            if count != self.peer_progress[peer][0]:
                self.peer_progress[peer] = (count, now)

    def _stuck_peer(self, now: float, patience: float) -> str | None:
        """The line naming a peer whose main thread stopped making progress, or None.

        A peer is stuck when its count of collectives has not moved for ``patience`` seconds while this rank
        waits for it: blocked as long in a later collective than the peer's last, or finished.
        """
        self._note_progress(now)
        own, own_since = self.own_progress
        for peer in self.peers:
            if peer in self.done:
                continue
            count, since = self.peer_progress[peer]
            if count < 0 or now - since <= patience:
                continue
            if self.finishing:
                return (f"rank {peer} failed: no progress for {now - since:.1f} s after rank {self.rank} finished "
                        f"(it issued {count} collectives, then none)")
            if count < own and now - own_since > patience:
                return (f"rank {peer} failed: no progress for {now - since:.1f} s (it issued {count} collectives; "
                        f"rank {self.rank} waits in its collective {own})")
        return None

    def _failed_after(self, peer: int) -> bool:
        """Whether ``peer`` posted a failure after this rank's (it was alive then)."""
        key = f"failed/{peer}"
        if self.own_failure is None or not self.store.check([key]):
            return False
        return int(self.store.get(key).decode().partition("|")[0]) > self.own_failure

    def _read_beat(self, peer: int) -> str | None:
        key = f"beat/{peer}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                verdict = self._check()
                self._store_error_since = None
            except Exception as exc:  # the store is gone: its host (rank 0 or the launcher) died
                now = time.monotonic()
                self._store_error_since = self._store_error_since or now
                if now - self._store_error_since < self.timeout_s:
                    continue
                host = "the launcher" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
                verdict = f"the c10d store (hosted by {host}) stopped answering: {type(exc).__name__}: {exc}"
                if host == "rank 0" and self.rank != 0:
                    verdict = f"rank 0 failed: {verdict}"
            if verdict is not None:
                self._post_stopping(verdict)
                self.exit(f"dcsched train: {verdict}")
                return

    def _post_stopping(self, verdict: str) -> None:
        """Tell the peers this rank stops because of another's failure, and give them a moment to read it.

        A peer waiting in :meth:`failed` learns it was not alone, and the store
        (which rank 0 may host) stays up while it reads.
        """
        try:
            self._post(f"stopped: {verdict}")
            time.sleep(self.interval_s)
        except Exception:
            pass

    def _check(self) -> str | None:
        """The line naming a failed peer, or None while all are well."""
        now = time.monotonic()
        posted = []
        for peer in self.peers:
            if peer in self.done:
                continue
            if self.store.check([f"failed/{peer}"]):
                seq, _, message = self.store.get(f"failed/{peer}").decode().partition("|")
                if self.own_failure is None or int(seq) < self.own_failure:
                    posted.append((int(seq), peer, message))
                continue
            if self.store.check([f"done/{peer}"]):
                self.done.add(peer)
                continue
            beat = self._read_beat(peer)
            if beat != self.last_beat[peer]:
                self.last_beat[peer], self.seen_at[peer] = beat, now
            elif now - self.seen_at[peer] > self.timeout_s:
                return f"rank {peer} failed: no heartbeat for {now - self.seen_at[peer]:.1f} s"
        if posted:
            _, peer, message = min(posted)
            return f"rank {peer} failed: {message}"
        return self._stuck_peer(now, self.timeout_s)


def _exit_with(line: str, code: int = 1) -> None:
    """Print ``line`` on stderr and end the process at once with exit ``code`` (after flushing)."""
    try:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
    finally:
        os._exit(code)
