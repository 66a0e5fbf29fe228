"""The ledger lock: ``NullLock`` for one thread, ``ProcessLock`` across threads and processes.

A lock is bound to the ledger's buffer by the ledger itself (``Ledger.create`` initialises the
shared mutex, ``Ledger.attach`` only binds)::

    led = Ledger.create(seg.ledger_buffer, Capacity(), lock=ProcessLock())

``ProcessLock`` is a *robust, process-shared* pthread mutex that lives in the ledger header.
It is taken with ``pthread_mutex_trylock`` called through ``ctypes.PyDLL`` (the GIL stays held,
~0.15 µs). When another process holds it: a few more trylocks (a holder on the other core lets
go within microseconds; skipped when the holder is a thread of this process, which needs the
GIL to go on), then a wait with the GIL released (``_wait``), so the process's other threads
keep working while the holder, perhaps descheduled, finishes; the mutex is never held while a
thread waits for the GIL. (A blocking call with the GIL held would freeze the whole process; a
``time.sleep(0)`` retry loop would cost a GIL hand-off per try.) When the previous holder died
holding it, the lock call returns ``EOWNERDEAD`` (the kernel also wakes a blocked waiter);
``acquire`` then reports the dead holder's pid so the ledger repairs before anything else and
calls ``consistent()``.

There is no process-local ``threading.Lock`` in front of the mutex: the C fast paths hold the
GIL through the whole critical section, so such a lock would only queue a process's threads
behind one that waits for another process, each of them then waiting in turn for the GIL (a
convoy), and it would cost two more calls per ledger operation. The mutex belongs to a thread:
the thread that acquires must release.

A process-shared mutex needs memory that is the same in every process: ``ProcessLock``
requires a buffer backed by an ``mmap`` (POSIX shared memory); a ``bytearray`` is refused.

The ``acquire()`` protocol: returns ``None`` normally, or the pid of a holder that died while
holding the lock (0 when unknown); the caller must then repair and call ``consistent()``.

Cost: a ledger call takes the lock once, so the uncontended acquire/release pair is on every
request twice. Once bound, ``acquire`` and ``release`` are closures over everything they touch
(the ctypes functions, the mutex address, the header view, the pid) instead of methods
reading attributes: less Python work around the two ctypes calls. They are rebuilt in a forked
child (new pid) and dropped by ``unbind``; the class methods remain the reference (and what
runs unbound).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
import weakref

from apf_gunicorn.ledger.layout import H_HOLDER_PID, H_MUTEX, MUTEX_BYTES, WORD

_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1
_SPINS = 20  # trylock attempts (~0.15 µs each) before a blocking wait


class LockBusy(Exception):
    """The lock is held by someone else and this thread must not wait for it (an event loop's:
    :meth:`ProcessLock.never_wait_on`). Raised by ``acquire`` before anything is held or
    changed, so the caller can run the same ledger call again on a thread that may wait."""


class NullLock:
    """No mutual exclusion: for single-threaded users (unit tests, the simulator)."""

    def bind(self, buf, words, create: bool) -> None:
        self._words = words

    def acquire(self) -> int | None:
        return None

    def never_wait_on(self, thread_ident: int) -> None:
        """Nothing to wait for without mutual exclusion."""

    def consistent(self) -> None:
        pass

    def release(self) -> None:
        pass


def _libc() -> ctypes.PyDLL:
    name = ctypes.util.find_library("c") or "libc.so.6"
    lib = ctypes.PyDLL(name, use_errno=True)  # PyDLL: the GIL is NOT released around calls
    for fn in ("pthread_mutex_trylock", "pthread_mutex_unlock", "pthread_mutex_consistent",
               "pthread_mutex_init", "pthread_mutexattr_init", "pthread_mutexattr_setpshared",
               "pthread_mutexattr_setrobust", "pthread_mutexattr_destroy"):
        getattr(lib, fn).restype = ctypes.c_int
    for fn in ("pthread_mutex_trylock", "pthread_mutex_unlock", "pthread_mutex_consistent"):
        getattr(lib, fn).argtypes = [ctypes.c_void_p]  # a bare int would be passed as C int
    return lib


def _libc_fast() -> ctypes.PyDLL:
    """trylock and unlock for the per-request path: no ``use_errno`` (the pthread functions
    return their error; saving and restoring errno around each call costs ~100 ns) and no
    ``argtypes`` (the caller passes a prebuilt ``ctypes.byref`` of the mutex, which needs no
    conversion): about half the cost of the checked calls."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    lib = ctypes.PyDLL(name)
    for fn in ("pthread_mutex_trylock", "pthread_mutex_unlock"):
        getattr(lib, fn).restype = ctypes.c_int
    return lib


def _libc_blocking() -> ctypes.CDLL:
    """``pthread_mutex_lock`` for the contended path without the C module (``_wait``):
    ``CDLL`` releases the GIL around the call, so waiting for another process's holder never
    stops this process's threads (but it returns holding the mutex, then waits for the GIL)."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    lib = ctypes.CDLL(name)
    lib.pthread_mutex_lock.restype = ctypes.c_int
    lib.pthread_mutex_lock.argtypes = [ctypes.c_void_p]
    return lib


def fastpath_module():
    """The optional C extension ``apf_gunicorn.ledger._fastpath``, or None: not built (no
    compiler at install time) or switched off with ``APF_NO_ACCELERATOR=1``."""
    if os.environ.get("APF_NO_ACCELERATOR", "") not in ("", "0"):
        return None
    try:
        from apf_gunicorn.ledger import _fastpath
    except ImportError:
        return None
    return _fastpath


# ProcessLock._wait's GIL-free wait, or None (then the ctypes pthread_mutex_lock)
_WAIT_UNLOCKED = getattr(fastpath_module(), "wait_unlocked", None)
_LIBC: ctypes.PyDLL | None = None
_LIBC_FAST: ctypes.PyDLL | None = None
_LIBC_BLOCKING: ctypes.CDLL | None = None


def _backing_is_mmap(buf) -> bool:
    obj = buf
    while isinstance(obj, memoryview):
        obj = obj.obj
    return isinstance(obj, mmap.mmap)


class ProcessLock:
    """The robust process-shared pthread mutex in the ledger header."""

    def __init__(self) -> None:
        global _LIBC, _LIBC_FAST, _LIBC_BLOCKING
        if _LIBC is None:
            _LIBC = _libc()
            _LIBC_FAST = _libc_fast()
            _LIBC_BLOCKING = _libc_blocking()
        self._lib = _LIBC
        self._trylock = _LIBC_FAST.pthread_mutex_trylock  # called with self._ref only
        self._unlock = _LIBC_FAST.pthread_mutex_unlock
        self._lock_blocking = _LIBC_BLOCKING.pthread_mutex_lock  # releases the GIL
        self._mutex = None
        self._addr = None
        self._ref = None  # ctypes.byref(self._mutex): the argument of trylock/unlock
        self._words = None
        self._pid = os.getpid()
        self._no_wait_thread = 0  # never_wait_on: a thread that gets LockBusy, not a wait
        ref = weakref.ref(self)

        def _after_fork() -> None:
            me = ref()
            if me is not None:
                me._pid = os.getpid()
                if me._addr is not None:
                    me._install_fast_ops()

        os.register_at_fork(after_in_child=_after_fork)

    def bind(self, buf, words, create: bool) -> None:
        if not _backing_is_mmap(buf):
            raise TypeError("ProcessLock needs a buffer backed by an mmap (POSIX shared "
                            "memory); a process-shared mutex cannot live in a bytearray")
        self._words = words
        self._mutex = (ctypes.c_char * MUTEX_BYTES).from_buffer(buf, H_MUTEX * WORD)
        self._addr = ctypes.addressof(self._mutex)
        self._ref = ctypes.byref(self._mutex)
        if create:
            lib = self._lib
            attr = ctypes.create_string_buffer(64)
            _check(lib.pthread_mutexattr_init(ctypes.byref(attr)), "pthread_mutexattr_init")
            _check(lib.pthread_mutexattr_setpshared(ctypes.byref(attr), _PTHREAD_PROCESS_SHARED),
                   "pthread_mutexattr_setpshared")
            _check(lib.pthread_mutexattr_setrobust(ctypes.byref(attr), _PTHREAD_MUTEX_ROBUST),
                   "pthread_mutexattr_setrobust")
            _check(lib.pthread_mutex_init(ctypes.c_void_p(self._addr), ctypes.byref(attr)),
                   "pthread_mutex_init")
            lib.pthread_mutexattr_destroy(ctypes.byref(attr))
        self._install_fast_ops()

    def _install_fast_ops(self) -> None:
        """``acquire``/``release`` as closures (instance attributes shadowing the methods):
        the same steps, without the attribute reads. Re-run whenever a captured value changes
        (bind, fork). Not for a subclass that overrides either: its methods must run."""
        cls = type(self)
        if cls.acquire is not ProcessLock.acquire or cls.release is not ProcessLock.release:
            return
        trylock = self._trylock
        unlock = self._unlock
        ref = self._ref
        words = self._words
        pid = self._pid
        slow = self._acquire_slow

        def acquire() -> int | None:
            rc = trylock(ref)
            if rc == 0:
                words[H_HOLDER_PID] = pid
                return None
            return slow(rc)

        def release() -> None:
            words[H_HOLDER_PID] = 0
            rc = unlock(ref)
            if rc:
                raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")

        self.acquire = acquire
        self.release = release

    def never_wait_on(self, thread_ident: int) -> None:
        """From now on, an ``acquire`` on thread ``thread_ident`` that finds the mutex held by
        another process (after the short spin) raises :class:`LockBusy` instead of waiting: an
        event loop must never block behind a holder that may be descheduled or stopped. The
        fast path is unchanged (only the contended, slow path reads this).

        Args:
            thread_ident: ``threading.get_ident()`` of that thread (0: none).
        """
        self._no_wait_thread = thread_ident

    def unbind(self) -> None:
        """Drop the ctypes view so the mmap can be closed."""
        self.__dict__.pop("acquire", None)
        self.__dict__.pop("release", None)
        self._mutex = None
        self._addr = None
        self._ref = None
        self._words = None

    def acquire(self) -> int | None:
        rc = self._trylock(self._ref)
        if rc == 0:
            self._words[H_HOLDER_PID] = self._pid
            return None
        return self._acquire_slow(rc)

    def _acquire_slow(self, rc: int) -> int | None:
        """Contended, or the holder died. A few more trylocks with the GIL held (a holder
        running on the other core lets go within microseconds; not when the holder is a thread
        of this process, which needs the GIL), then :meth:`_wait`, which releases the GIL:
        this process's other threads keep serving while the holder, perhaps descheduled,
        finishes."""
        if rc == errno.EBUSY:
            trylock = self._trylock
            ref = self._ref
            spins = 0 if self._words[H_HOLDER_PID] == self._pid else _SPINS
            for _ in range(spins):
                rc = trylock(ref)
                if rc != errno.EBUSY:
                    break
            else:
                if self._no_wait_thread and threading.get_ident() == self._no_wait_thread:
                    raise LockBusy
                rc = self._wait(self._addr)
        if rc == 0:
            self._words[H_HOLDER_PID] = self._pid
            return None
        if rc == errno.EOWNERDEAD:
            dead = int(self._words[H_HOLDER_PID])
            self._words[H_HOLDER_PID] = self._pid
            return dead
        raise OSError(rc, f"pthread_mutex_lock: {os.strerror(rc)}")

    def _wait(self, addr: int) -> int:
        """Block, GIL released, until the mutex is ours; a pthread return code.

        With the C accelerator: ``wait_unlocked`` waits until the mutex is *free* (lock and
        unlock with the GIL released), then trylock with the GIL held, again if another
        process got there first. Plain ``pthread_mutex_lock`` through ``ctypes.CDLL`` returns
        holding the mutex and only then waits for the GIL, up to the 5 ms switch interval
        while another thread runs Python: the lock is held all that time and every other
        worker stalls behind it. (``EOWNERDEAD`` from ``wait_unlocked`` means it is held.)"""
        wait = _WAIT_UNLOCKED
        if wait is None:
            return self._lock_blocking(addr)
        trylock = self._trylock
        ref = self._ref
        while True:
            rc = wait(addr)
            if rc != 0:
                return rc
            rc = trylock(ref)
            if rc != errno.EBUSY:
                return rc

    def consistent(self) -> None:
        _check(self._lib.pthread_mutex_consistent(self._addr), "pthread_mutex_consistent")

    def release(self) -> None:
        self._words[H_HOLDER_PID] = 0
        rc = self._unlock(self._ref)
        if rc:
            raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")


def _check(rc: int, what: str) -> None:
    if rc:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")
