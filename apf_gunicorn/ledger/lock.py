"""The ledger lock: ``NullLock`` for one thread, ``ProcessLock`` across threads and processes.

A lock is bound to the ledger's buffer by the ledger itself (``Ledger.create`` initialises the
shared mutex, ``Ledger.attach`` only binds)::

    led = Ledger.create(seg.ledger_buffer, Capacity(), lock=ProcessLock())

``ProcessLock`` is a process-local ``threading.Lock`` (so the threads of one process queue on
the GIL-friendly lock) followed by a *robust, process-shared* pthread mutex that lives in the
ledger header. The mutex is taken with ``pthread_mutex_trylock`` called through
``ctypes.PyDLL`` (the GIL stays held, ~0.15 µs) and ``time.sleep(0)`` backoff: a blocking
``pthread_mutex_lock`` with the GIL held would freeze the whole process while another process
holds the mutex. When the previous holder died holding it, trylock returns ``EOWNERDEAD``;
``acquire`` then reports the dead holder's pid so the ledger repairs before anything else and
calls ``consistent()``.

A process-shared mutex needs memory that is the same in every process: ``ProcessLock``
requires a buffer backed by an ``mmap`` (POSIX shared memory); a ``bytearray`` is refused.

The ``acquire()`` protocol: returns ``None`` normally, or the pid of a holder that died while
holding the lock (0 when unknown); the caller must then repair and call ``consistent()``.

Cost: a ledger call takes the lock once, so the uncontended acquire/release pair is on every
request twice. Once bound, ``acquire`` and ``release`` are closures over everything they touch
(bound methods of the threading lock, the ctypes functions, the mutex address, the header
view, the pid) instead of methods reading five attributes each: about 40% less Python work
around the two ctypes calls. They are rebuilt in a forked child (new threading lock, new pid)
and dropped by ``unbind``; the class methods remain the reference (and what runs unbound).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
import time
import weakref

from apf_gunicorn.ledger.layout import H_HOLDER_PID, H_MUTEX, MUTEX_BYTES, WORD

_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1
_SPINS_BEFORE_SLEEP = 200


class NullLock:
    """No mutual exclusion: for single-threaded users (unit tests, the simulator)."""

    def bind(self, buf, words, create: bool) -> None:
        self._words = words

    def acquire(self) -> int | None:
        return None

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


_LIBC: ctypes.PyDLL | None = None
_LIBC_FAST: ctypes.PyDLL | None = None


def _backing_is_mmap(buf) -> bool:
    obj = buf
    while isinstance(obj, memoryview):
        obj = obj.obj
    return isinstance(obj, mmap.mmap)


class ProcessLock:
    """``threading.Lock`` + robust process-shared pthread mutex in the ledger header."""

    def __init__(self, spin_sleep_s: float = 50e-6) -> None:
        global _LIBC, _LIBC_FAST
        if _LIBC is None:
            _LIBC = _libc()
            _LIBC_FAST = _libc_fast()
        self._lib = _LIBC
        self._trylock = _LIBC_FAST.pthread_mutex_trylock  # called with self._ref only
        self._unlock = _LIBC_FAST.pthread_mutex_unlock
        self._tlock = threading.Lock()
        self._spin_sleep_s = spin_sleep_s
        self._mutex = None
        self._addr = None
        self._ref = None  # ctypes.byref(self._mutex): the argument of trylock/unlock
        self._words = None
        self._pid = os.getpid()
        ref = weakref.ref(self)

        def _after_fork() -> None:
            me = ref()
            if me is not None:
                me._tlock = threading.Lock()
                me._pid = os.getpid()
                if me._addr is not None:
                    me._install_fast_ops()

        # a thread of the parent may have held the threading.Lock at fork time
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
        tl_acquire = self._tlock.acquire
        tl_release = self._tlock.release
        trylock = self._trylock
        unlock = self._unlock
        ref = self._ref
        words = self._words
        pid = self._pid
        slow = self._acquire_slow

        def acquire() -> int | None:
            tl_acquire()
            rc = trylock(ref)
            if rc == 0:
                words[H_HOLDER_PID] = pid
                return None
            return slow(rc)

        def release() -> None:
            words[H_HOLDER_PID] = 0
            rc = unlock(ref)
            tl_release()
            if rc:
                raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")

        self.acquire = acquire
        self.release = release

    def unbind(self) -> None:
        """Drop the ctypes view so the mmap can be closed."""
        self.__dict__.pop("acquire", None)
        self.__dict__.pop("release", None)
        self._mutex = None
        self._addr = None
        self._ref = None
        self._words = None

    def acquire(self) -> int | None:
        self._tlock.acquire()
        rc = self._trylock(self._ref)
        if rc == 0:
            self._words[H_HOLDER_PID] = self._pid
            return None
        return self._acquire_slow(rc)

    def _acquire_slow(self, rc: int) -> int | None:
        ref = self._ref
        trylock = self._trylock
        spins = 0
        while True:
            if rc == 0:
                self._words[H_HOLDER_PID] = self._pid
                return None
            if rc == errno.EBUSY:
                spins += 1
                # sleep(0) yields the GIL; after a while back off for real so a descheduled
                # holder in another process gets the CPU
                time.sleep(0 if spins < _SPINS_BEFORE_SLEEP else self._spin_sleep_s)
                rc = trylock(ref)
                continue
            if rc == errno.EOWNERDEAD:
                dead = int(self._words[H_HOLDER_PID])
                self._words[H_HOLDER_PID] = self._pid
                return dead
            self._tlock.release()
            raise OSError(rc, f"pthread_mutex_trylock: {os.strerror(rc)}")

    def consistent(self) -> None:
        _check(self._lib.pthread_mutex_consistent(self._addr), "pthread_mutex_consistent")

    def release(self) -> None:
        self._words[H_HOLDER_PID] = 0
        rc = self._unlock(self._ref)
        self._tlock.release()
        if rc:
            raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")


def _check(rc: int, what: str) -> None:
    if rc:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")
