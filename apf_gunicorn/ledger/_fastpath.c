/* The ledger's two per-request fast paths in C: ``admit`` of a request that runs at once and
 * ``finish`` of one that leaves nothing behind. Optional: ``ledger.py`` has the same paths in
 * Python and uses this module only when it imports and its layout matches (``LAYOUT``).
 *
 * Why C: in Python the two paths are ~1,000 bytecodes per request under the ledger lock; a
 * forced GIL switch or a preemption inside them stalls every other worker waiting for the
 * lock, and their cost is most of APF's overhead (docs/server.md, "Overhead"). Here they are
 * a few hundred machine instructions with the GIL held throughout, so no other thread of the
 * process can run inside the critical section.
 *
 * Contract (ledger.py relies on it): each call either completes the operation exactly as the
 * Python fast path would (same words written, same float operations in the same order) and
 * returns its result, or returns
 *   None  - nothing done, no lock held: run the Python operation from the start;
 *   -1    - the lock is held (fast-path conditions not met, or the ledger is dirty): run the
 *           Python operation from just after its lock acquire, dead=None;
 *   pid   - (>= 0) the lock is held and its previous holder died: the same, dead=pid.
 * Nothing is written before the call knows it will complete.
 *
 * ``admit_call`` and ``finish_call`` are the same with the hand-over done here: on a decline
 * they call the resume functions given to ``set_resume`` (``Ledger._admit_resume`` and
 * ``_finish_resume``) with the decline value first, then the call's own arguments; a call
 * with keywords goes there directly (value None). ``Ledger`` installs them as its ``admit``
 * and ``finish``, which saves a Python frame per operation. Locking mirrors
 * ``ProcessLock.acquire``: ``pthread_mutex_trylock`` on the robust mutex in the ledger header,
 * a short spin while another process holds it; with lock mode 0 (a ``NullLock``) there is no
 * locking.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* layout.py's constants (generated: scripts/layout_header.py), checked against LAYOUT and
 * LAYOUT_DIGEST at import */
#include "_layout.h"

/* stores to the ledger stay in program order (the undo log before what it covers) */
#define COMPILER_BARRIER() __asm__ __volatile__("" ::: "memory")

#define EXACT_BOUND ((__int128)1 << 50)
#define HIGH_R (((uint64_t)-1 / 2) + ((uint64_t)-1 / 2) / 2)
#define MAX_DUR 64
#define MAX_HAND 64
#define SEATS_LIMIT ((int64_t)1 << 31)
#define AL_LIMIT ((int64_t)1 << 62)
#define MAX_SERVICE_NS ((int64_t)60000000000) /* ledger.MAX_SERVICE_ESTIMATE_NS */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int have_view;
    char *base;
    int64_t *w;
    uint64_t *u;
    double *f;
    pthread_mutex_t *mutex;
    int lock_mode;
    int64_t pid;
    PyObject *stats_at;      /* dict: (serial << 32) | fs -> stats entry word address */
    PyTypeObject *result_type; /* AdmitResult */
    PyObject *execute;       /* "execute" */
    PyObject *empty;         /* "" */
    PyObject *admit_resume;  /* Ledger._admit_resume(decline, *args, **kw), or NULL */
    PyObject *finish_resume; /* Ledger._finish_resume(decline, *args, **kw), or NULL */
    int64_t lvb, qb, sb, nlevels, nslots, details, detail_stride, detail_bytes;
    int64_t e_work_sum, e_wait_x, e_exec_r, exec_stride, nd, ub;
    int64_t work_at[102];    /* bucket word for 0..100 seats; [101] for more */
    int64_t dur[MAX_DUR];
    int ndur;
    /* the maxmin areas (set_maxmin); have_mm 0: maxmin levels are declined */
    int have_mm;
    int64_t mmb, fhb, fb, ib, xb;
    uint64_t imask;
} FastPath;

/* -- locking ---------------------------------------------------------------------------- */

#define SPINS 200 /* trylocks before declining: ~5-10 us, a few critical sections */

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* 1: locked, *dead = -1 or the dead holder's pid; 0: not locked (nothing held). */
static int
take_lock(FastPath *self, int64_t *dead)
{
    *dead = -1;
    if (self->lock_mode == 0)
        return 1;
    int rc = pthread_mutex_trylock(self->mutex);
    /* A holder running on another core lets go within a microsecond or two: spin briefly
     * rather than decline into the Python path, whose blocking wait costs GIL hand-offs.
     * Not when the holder is a thread of this process: it needs the GIL this thread holds. */
    for (int i = 0; rc == EBUSY && self->w[H_HOLDER_PID] != self->pid && i < SPINS; i++) {
        cpu_relax();
        rc = pthread_mutex_trylock(self->mutex);
    }
    if (rc == 0) {
        self->w[H_HOLDER_PID] = self->pid;
        return 1;
    }
    if (rc == EOWNERDEAD) {
        *dead = self->w[H_HOLDER_PID];
        self->w[H_HOLDER_PID] = self->pid;
        return 1;
    }
    return 0;
}

static void
drop_lock(FastPath *self)
{
    if (self->lock_mode == 0)
        return;
    self->w[H_HOLDER_PID] = 0;
    pthread_mutex_unlock(self->mutex);
}

/* -- arithmetic, as seatseconds.py -------------------------------------------------------- */

#define SERVICE_WINDOW 16 /* ledger.SERVICE_WINDOW */

/* Ledger._learn: the level at w + lb learns from a request that ran ``ran`` ns */
static inline void
learn_service(int64_t *w, int64_t lb, int64_t ran)
{
    int64_t n = w[lb + L_SERVICE_N], g = w[lb + L_SERVICE_NS];
    if (n < SERVICE_WINDOW)
        w[lb + L_SERVICE_N] = ++n;
    if (ran < 0)
        ran = 0;
    else if (ran > MAX_SERVICE_NS)
        ran = MAX_SERVICE_NS;
    w[lb + L_SERVICE_NS] = ran >= g ? g + (ran - g) / n : g - (g - ran) / n;
}

/* seats_ns_times where it is exact in integers; 0 when outside that range (caller declines) */
static int
exact_seats_ns(int64_t seats, int64_t ns, uint64_t *out)
{
    __int128 x = (__int128)seats * (__int128)ns;
    if (x >= 0 && x < EXACT_BOUND) {
        *out = (uint64_t)((x + 5) / 10);
        return 1;
    }
    if (x < 0 && x > -EXACT_BOUND) {
        *out = (uint64_t)(-(int64_t)((5 - x) / 10));
        return 1;
    }
    return 0;
}

/* seats_times_duration(float seats, ns): Go's math.Round(seats * ns / 10) as int64 -> uint64 */
static uint64_t
seats_times_duration(double seats, int64_t ns)
{
    double x = seats * (double)ns / 10;
    const double two63 = 9223372036854775808.0;
    if (x >= -two63 && x < two63) {
        int64_t t = (int64_t)x;
        double d = x - (double)t;
        if (d >= 0.5) {
            if (t == INT64_MAX)
                return (uint64_t)INT64_MIN;
            t += 1;
        }
        else if (d <= -0.5)
            t -= 1;
        return (uint64_t)t;
    }
    return (uint64_t)INT64_MIN;
}

/* the virtual clock advance of syncTimeLocked; 0: not on the fast path (caller declines) */
static int
advance_r(int64_t qseats, int64_t c, int64_t active, int64_t dt, uint64_t *r)
{
    int64_t seats = qseats < c ? qseats : c;
    uint64_t nr;
    if (active == 1) {
        __int128 x = (__int128)seats * (__int128)dt;
        if (!(x >= 0 && x < EXACT_BOUND))
            return 0;
        nr = (uint64_t)((x + 5) / 10);
    }
    else
        nr = seats_times_duration((double)seats / (double)active, dt);
    nr = *r + nr;
    if (nr >= HIGH_R && nr >= *r)
        return 0; /* the epoch advance: Python's slow path */
    *r = nr;
    return 1;
}

static double
go_seconds(int64_t dt)
{
    if (dt < 1000000000)
        return (double)dt / 1e9;
    int64_t sec = dt / 1000000000, nsec = dt % 1000000000;
    return (double)sec + (double)nsec / 1e9;
}

/* the seat-demand integrator's Set(): accumulate the old value over the time since the last */
static inline void
integrate(double *it, double *ix, double *ixx, double cur, int64_t *ilast, int64_t now)
{
    if (now > *ilast) {
        double dt = go_seconds(now - *ilast);
        *it += dt;
        *ix += cur * dt;
        *ixx += cur * cur * dt;
        *ilast = now;
    }
}

static int64_t
deal_card(uint64_t h, int64_t deck, int64_t k)
{
    int64_t rem[MAX_HAND];
    for (int64_t i = 0; i <= k; i++) {
        uint64_t d = (uint64_t)(deck - i);
        rem[i] = (int64_t)(h % d);
        h /= d;
    }
    int64_t card = rem[k];
    for (int64_t j = k; j > 0; j--)
        if (card >= rem[j - 1])
            card += 1;
    return card;
}

/* -- maxmin: the flow words of the fast paths (maxmin.py at_once_locked and
 * main_phase_ended_locked for a level with nothing waiting), word for word ------------------- */

/* layout.py's maxmin words come from _layout.h too; LAYOUT_MAXMIN lists those read here */

static inline uint64_t
mm_mix(int64_t level, uint64_t h) /* flowtable.flow_mix */
{
    uint64_t x = h ^ ((uint64_t)level * 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline __attribute__((always_inline)) int64_t
mm_find(FastPath *self, int64_t level, uint64_t h)
{
    int64_t *w = self->w;
    uint64_t i = mm_mix(level, h) & self->imask;
    for (;;) {
        int64_t e = w[self->ib + (int64_t)i];
        if (e == 0)
            return NIL;
        int64_t fa = self->fb + (e - 1) * FLOW_WORDS;
        if (self->u[fa + F_HASH] == h && w[fa + F_LEVEL] == level)
            return e - 1;
        i = (i + 1) & self->imask;
    }
}

static void
mm_index_delete(FastPath *self, int64_t f, int64_t fa)
{
    int64_t *w = self->w;
    uint64_t mask = self->imask;
    uint64_t i = mm_mix(w[fa + F_LEVEL], self->u[fa + F_HASH]) & mask;
    while (w[self->ib + (int64_t)i] != f + 1)
        i = (i + 1) & mask;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        int64_t e = w[self->ib + (int64_t)j];
        if (e == 0)
            break;
        int64_t ea = self->fb + (e - 1) * FLOW_WORDS;
        uint64_t home = mm_mix(w[ea + F_LEVEL], self->u[ea + F_HASH]) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            w[self->ib + (int64_t)i] = e;
            i = j;
        }
    }
    w[self->ib + (int64_t)i] = 0;
}

static void
mm_idle_remove(FastPath *self, int64_t fa)
{
    int64_t *w = self->w;
    int64_t p = w[fa + F_PREV], n = w[fa + F_NEXT];
    if (p == NIL)
        w[self->fhb + FH_IDLE_HEAD] = n;
    else
        w[self->fb + p * FLOW_WORDS + F_NEXT] = n;
    if (n == NIL)
        w[self->fhb + FH_IDLE_TAIL] = p;
    else
        w[self->fb + n * FLOW_WORDS + F_PREV] = p;
    w[fa + F_NEXT] = NIL;
    w[fa + F_PREV] = NIL;
    w[fa + F_WHERE] = FW_NOWHERE;
}

/* the flow's entry, active (maxmin._get); the caller checked that one can be had. Inlined
 * into both callers: as a call, the C at-once admit costs ~45 instructions more */
static inline __attribute__((always_inline)) int64_t
mm_get(FastPath *self, int64_t mm, int64_t level, uint64_t h)
{
    int64_t *w = self->w;
    uint64_t *u = self->u;
    int64_t f = mm_find(self, level, h), fa;
    if (f != NIL) {
        fa = self->fb + f * FLOW_WORDS;
        if (w[fa + F_WHERE] == FW_IDLE) {
            mm_idle_remove(self, fa);
            w[mm + M_NFLOWS] += 1;
        }
        return f;
    }
    f = w[self->fhb + FH_FREE];
    if (f != NIL) {
        fa = self->fb + f * FLOW_WORDS;
        w[self->fhb + FH_FREE] = w[fa + F_NEXT];
    }
    else {
        f = w[self->fhb + FH_IDLE_HEAD];
        fa = self->fb + f * FLOW_WORDS;
        mm_idle_remove(self, fa);
        mm_index_delete(self, f, fa);
        w[self->fhb + FH_EVICTIONS] += 1;
    }
    w[fa + F_LEVEL] = level;
    u[fa + F_HASH] = h;
    u[fa + F_TAG] = u[mm + M_V];
    w[fa + F_SEQ] = w[fa + F_WAITING] = w[fa + F_EXEC] = w[fa + F_SEATS] = 0;
    w[fa + F_EST] = w[fa + F_N] = 0;
    w[fa + F_HEAD] = w[fa + F_TAIL] = w[fa + F_CHILD] = w[fa + F_NEXT] = w[fa + F_PREV] = NIL;
    w[fa + F_WHERE] = FW_NOWHERE;
    uint64_t i = mm_mix(level, h) & self->imask;
    while (w[self->ib + (int64_t)i])
        i = (i + 1) & self->imask;
    w[self->ib + (int64_t)i] = f + 1;
    w[mm + M_NFLOWS] += 1;
    return f;
}

/* maxmin.at_once_locked: returns the estimate charged */
static int64_t
mm_at_once(FastPath *self, int64_t lb, int64_t level, uint64_t h, int64_t slot, int64_t held,
           int64_t al)
{
    int64_t *w = self->w;
    uint64_t *u = self->u;
    int64_t mm = self->mmb + level * MM_WORDS;
    int64_t f = mm_get(self, mm, level, h);
    int64_t fa = self->fb + f * FLOW_WORDS;
    uint64_t v = u[mm + M_V], tag = u[fa + F_TAG];
    if ((int64_t)(tag - v) < 0)
        tag = v;
    int64_t seq = w[mm + M_SEQ] + 1;
    w[mm + M_SEQ] = seq;
    w[fa + F_SEQ] = seq;
    if ((int64_t)(v - tag) < 0)
        u[mm + M_V] = tag;
    int64_t est = w[fa + F_N] ? w[fa + F_EST] : w[lb + L_SERVICE_NS];
    u[fa + F_TAG] = tag + (uint64_t)held * (uint64_t)(est + al);
    w[fa + F_EXEC] += 1;
    w[fa + F_SEATS] += held;
    w[self->xb + slot * XSLOT_WORDS + X_FLOW] = f;
    return est;
}

/* maxmin.main_phase_ended_locked for a flow with nothing waiting and no lingering */
static void
mm_finish(FastPath *self, int64_t level, int64_t slot, int64_t f, int64_t held, int64_t ran,
          int64_t est)
{
    int64_t *w = self->w;
    uint64_t *u = self->u;
    int64_t fa = self->fb + f * FLOW_WORDS, mm = self->mmb + level * MM_WORDS;
    w[self->xb + slot * XSLOT_WORDS + X_FLOW] = NIL;
    u[fa + F_TAG] = u[fa + F_TAG] + (uint64_t)held * (uint64_t)(ran - est);
    int64_t n = w[fa + F_N];
    if (n < SERVICE_WINDOW)
        w[fa + F_N] = ++n;
    int64_t g = n > 1 ? w[fa + F_EST] : 0, r = ran;
    if (r < 0)
        r = 0;
    else if (r > MAX_SERVICE_NS)
        r = MAX_SERVICE_NS;
    w[fa + F_EST] = r >= g ? g + (r - g) / n : g - (g - r) / n;
    w[fa + F_EXEC] -= 1;
    w[fa + F_SEATS] -= held;
    if (w[fa + F_WAITING] == 0 && w[fa + F_EXEC] == 0) { /* idle: onto the LRU list */
        int64_t tail = w[self->fhb + FH_IDLE_TAIL];
        w[fa + F_WHERE] = FW_IDLE;
        w[fa + F_NEXT] = NIL;
        w[fa + F_PREV] = tail;
        if (tail == NIL)
            w[self->fhb + FH_IDLE_HEAD] = f;
        else
            w[self->fb + tail * FLOW_WORDS + F_NEXT] = f;
        w[self->fhb + FH_IDLE_TAIL] = f;
        w[mm + M_NFLOWS] -= 1;
    }
}

/* -- maxmin: the pairing heap of backlogged flows (flowheap.py), for the general path ---------
 * The same words written in the same order as flowheap.py's _meld, _merge_pairs, _cut,
 * _heap_insert, _heap_remove and _heap_decrease; ``FastPaths._accelerate`` binds the methods
 * below over those of the policy object (tests/test_ledger_accelerator.py compares them). */

/* flow a before flow b (flowheap._less): smaller tag, fewer seats held, longer backlogged */
static inline int
mm_before(const int64_t *w, const uint64_t *u, int64_t aa, int64_t ba)
{
    uint64_t ta = u[aa + F_TAG], tb = u[ba + F_TAG];
    if (ta != tb)
        return (int64_t)(ta - tb) < 0;
    int64_t sa = w[aa + F_SEATS], sb = w[ba + F_SEATS];
    if (sa != sb)
        return sa < sb;
    return w[aa + F_SEQ] < w[ba + F_SEQ];
}

static int64_t
mm_meld(FastPath *self, int64_t a, int64_t b)
{
    if (a == NIL)
        return b;
    if (b == NIL)
        return a;
    int64_t *w = self->w;
    int64_t fb = self->fb;
    int64_t aa = fb + a * FLOW_WORDS, ba = fb + b * FLOW_WORDS;
    if (mm_before(w, self->u, ba, aa)) {
        int64_t t = a; a = b; b = t;
        t = aa; aa = ba; ba = t;
    }
    int64_t c = w[aa + F_CHILD];
    w[ba + F_NEXT] = c;
    if (c != NIL)
        w[fb + c * FLOW_WORDS + F_PREV] = b;
    w[ba + F_PREV] = a;
    w[aa + F_CHILD] = b;
    return a;
}

static int64_t
mm_merge_pairs(FastPath *self, int64_t first)
{
    int64_t *w = self->w;
    int64_t fb = self->fb;
    int64_t acc = NIL, x = first;
    while (x != NIL) {
        int64_t a = x, aa = fb + a * FLOW_WORDS, nxt;
        int64_t b = w[aa + F_NEXT];
        if (b != NIL) {
            int64_t ba = fb + b * FLOW_WORDS;
            nxt = w[ba + F_NEXT];
            if (mm_before(w, self->u, ba, aa)) {
                int64_t t = a; a = b; b = t;
                t = aa; aa = ba; ba = t;
            }
            int64_t c = w[aa + F_CHILD];
            w[ba + F_NEXT] = c;
            if (c != NIL)
                w[fb + c * FLOW_WORDS + F_PREV] = b;
            w[ba + F_PREV] = a;
            w[aa + F_CHILD] = b;
        }
        else
            nxt = NIL;
        w[aa + F_NEXT] = acc;
        acc = a;
        x = nxt;
    }
    int64_t res = NIL;
    while (acc != NIL) {
        int64_t aa = fb + acc * FLOW_WORDS;
        int64_t nxt = w[aa + F_NEXT];
        w[aa + F_NEXT] = NIL;
        res = mm_meld(self, res, acc);
        acc = nxt;
    }
    return res;
}

static void
mm_cut(FastPath *self, int64_t f, int64_t fa)
{
    int64_t *w = self->w;
    int64_t p = w[fa + F_PREV], n = w[fa + F_NEXT];
    int64_t pa = self->fb + p * FLOW_WORDS;
    if (w[pa + F_CHILD] == f)
        w[pa + F_CHILD] = n;
    else
        w[pa + F_NEXT] = n;
    if (n != NIL)
        w[self->fb + n * FLOW_WORDS + F_PREV] = p;
}

static void
mm_heap_insert(FastPath *self, int64_t mm, int64_t f)
{
    int64_t *w = self->w;
    int64_t fa = self->fb + f * FLOW_WORDS;
    w[fa + F_CHILD] = NIL;
    w[fa + F_NEXT] = NIL;
    w[fa + F_PREV] = NIL;
    w[fa + F_WHERE] = FW_HEAP;
    w[mm + M_ROOT] = mm_meld(self, w[mm + M_ROOT], f);
}

static void
mm_heap_remove(FastPath *self, int64_t mm, int64_t f)
{
    int64_t *w = self->w;
    int64_t fa = self->fb + f * FLOW_WORDS;
    if (f == w[mm + M_ROOT]) {
        int64_t root = mm_merge_pairs(self, w[fa + F_CHILD]);
        if (root != NIL)
            w[self->fb + root * FLOW_WORDS + F_PREV] = NIL;
        w[mm + M_ROOT] = root;
    }
    else {
        mm_cut(self, f, fa);
        int64_t sub = mm_merge_pairs(self, w[fa + F_CHILD]);
        if (sub != NIL)
            w[self->fb + sub * FLOW_WORDS + F_PREV] = NIL;
        w[mm + M_ROOT] = mm_meld(self, w[mm + M_ROOT], sub);
    }
    w[fa + F_CHILD] = NIL;
    w[fa + F_NEXT] = NIL;
    w[fa + F_PREV] = NIL;
    w[fa + F_WHERE] = FW_NOWHERE;
}

static void
mm_heap_decrease(FastPath *self, int64_t mm, int64_t f)
{
    int64_t *w = self->w;
    int64_t root = w[mm + M_ROOT];
    if (f == root)
        return;
    int64_t fa = self->fb + f * FLOW_WORDS;
    mm_cut(self, f, fa);
    w[fa + F_NEXT] = NIL;
    w[fa + F_PREV] = NIL;
    w[mm + M_ROOT] = mm_meld(self, root, f);
}

/* The arguments of the mm_* methods: n word addresses and indices, each checked against the
 * buffer (a bad one raises, nothing written), since Python code calls them. */
static int
mm_args(FastPath *self, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n, int64_t *out,
        const char *name)
{
    if (!self->have_view || !self->have_mm) {
        PyErr_Format(PyExc_ValueError, "%s: the ledger is closed or has no maxmin areas", name);
        return 0;
    }
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, n, nargs);
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(args[i]);
        if (v == -1 && PyErr_Occurred())
            return 0;
        out[i] = v;
    }
    return 1;
}

/* mm is a level's maxmin words, f a flow entry */
static int
mm_check(FastPath *self, int64_t mm, int64_t f, const char *name)
{
    if (mm < self->mmb || mm >= self->mmb + self->nlevels * MM_WORDS
        || (mm - self->mmb) % MM_WORDS != 0 || f < 0 || f >= self->nslots) {
        PyErr_Format(PyExc_IndexError, "%s: no such level words or flow entry", name);
        return 0;
    }
    return 1;
}

#define MM_HEAP_METHOD(pyname, cfunc)                                                        \
    static PyObject *                                                                         \
    pyname(FastPath *self, PyObject *const *args, Py_ssize_t nargs)                           \
    {                                                                                         \
        int64_t a[2];                                                                         \
        if (!mm_args(self, args, nargs, 2, a, #cfunc) || !mm_check(self, a[0], a[1], #cfunc)) \
            return NULL;                                                                      \
        cfunc(self, a[0], a[1]);                                                              \
        Py_RETURN_NONE;                                                                       \
    }

MM_HEAP_METHOD(fp_mm_heap_insert, mm_heap_insert)
MM_HEAP_METHOD(fp_mm_heap_remove, mm_heap_remove)
MM_HEAP_METHOD(fp_mm_heap_decrease, mm_heap_decrease)

/* flowtable._get: the flow's entry, made active (the hash a uint64) */
static PyObject *
fp_mm_get(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t a[2];
    if (!mm_args(self, args, nargs == 3 ? 2 : nargs, 2, a, "mm_get")
        || !mm_check(self, a[0], 0, "mm_get"))
        return NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "mm_get takes 3 arguments");
        return NULL;
    }
    uint64_t h = PyLong_AsUnsignedLongLong(args[2]);
    if (h == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    if (a[1] < 0 || a[1] >= self->nlevels) {
        PyErr_SetString(PyExc_IndexError, "mm_get: no such level");
        return NULL;
    }
    if (mm_find(self, a[1], h) == NIL && self->w[self->fhb + FH_FREE] == NIL
        && self->w[self->fhb + FH_IDLE_HEAD] == NIL) {
        PyErr_SetString(PyExc_AssertionError, "maxmin: no flow entry to reuse");
        return NULL;
    }
    return PyLong_FromLongLong(mm_get(self, a[0], a[1], h));
}

static int
as_i64(PyObject *o, int64_t *out)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (overflow)
        return 0;
    *out = v;
    return 1;
}

/* A hand-over that cannot happen (no memory for the decline value, the ledger closed): give
 * the lock back rather than leave it held forever. A dead holder's mutex is made consistent
 * first (unlocking it otherwise would make it unusable for good) and the ledger marked dirty,
 * so the next locker repairs what the dead holder left. */
static void
abandon_lock(FastPath *self, int64_t dead)
{
    if (self->lock_mode == 0)
        return;
    if (dead >= 0)
        pthread_mutex_consistent(self->mutex);
    self->w[H_DIRTY] = 1;
    drop_lock(self);
}

/* the lock stays held: Python continues the operation after its lock acquire */
static PyObject *
declined(FastPath *self, int64_t dead)
{
    PyObject *v = PyLong_FromLongLong(dead);
    if (v == NULL)
        abandon_lock(self, dead);
    return v;
}

/* -- admit -------------------------------------------------------------------------------- */

static PyObject *
fp_admit(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t level, initial, final, al, owner, now, fs_index, dead;
    if (nargs != 10 || !self->have_view)
        Py_RETURN_NONE;
    if (!as_i64(args[0], &level) || !as_i64(args[2], &initial) || !as_i64(args[3], &final)
        || !as_i64(args[4], &al) || !as_i64(args[5], &owner) || !as_i64(args[6], &now)
        || !as_i64(args[7], &fs_index) || !PyLong_Check(args[1]) || !PyBytes_CheckExact(args[8]))
        Py_RETURN_NONE;
    if (initial < 0 || initial >= SEATS_LIMIT || final < 0 || final >= SEATS_LIMIT || al < 0
        || al >= AL_LIMIT)
        Py_RETURN_NONE;
    uint64_t h = PyLong_AsUnsignedLongLongMask(args[1]);
    if (h == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int watch = PyObject_IsTrue(args[9]);
    if (watch < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (!take_lock(self, &dead))
        Py_RETURN_NONE;
    int64_t *w = self->w;
    uint64_t *u = self->u;
    double *f = self->f;
    if (dead >= 0 || w[H_DIRTY] || level < 0 || level >= self->nlevels)
        return declined(self, dead);
    int64_t lb = self->lvb + level * LEVEL_WORDS;
    int64_t fair = w[lb + L_FAIRNESS];
    if (w[lb + L_WAITING] || (fair && !self->have_mm))
        return declined(self, -1);
    /* maxmin: a flow entry to be had (found, free or idle; the last two always, in fact) */
    if (fair && w[self->fhb + FH_FREE] == NIL && w[self->fhb + FH_IDLE_HEAD] == NIL)
        return declined(self, -1);
    int64_t ms = initial >= final ? initial : final;
    int64_t used = w[lb + L_USED], desired = w[lb + L_DESIRED], hs = w[lb + L_HAND];
    int64_t c = w[lb + L_C], qbase = w[lb + L_QBASE], serial = w[lb + L_SERIAL];
    int64_t sw = w[lb + L_SEATS_WAITING];
    uint64_t r = u[lb + L_R];
    int64_t last = w[lb + L_LAST_NS], executing = w[lb + L_EXECUTING];
    int64_t in_use = w[lb + L_SEATS_IN_USE], active = w[lb + L_ACTIVE_QUEUES];
    int64_t qseats = w[lb + L_QSEATS];
    double it = f[lb + L_I_T], ix = f[lb + L_I_X], ixx = f[lb + L_I_XX];
    double imn = f[lb + L_I_MIN], imx = f[lb + L_I_MAX], cur = f[lb + L_I_CUR];
    int64_t ilast = w[lb + L_I_LAST], enq = w[lb + L_ENQUEUES];
    int64_t dispatched = w[lb + L_DISPATCHED];
    int64_t head = w[H_FREE_HEAD], nfree = w[H_FREE_COUNT];
    /* Python's fast-path test, narrowed: no final-seat cap, and a sane record */
    if (!(used && desired > 0 && head != NIL && in_use < c && in_use + ms <= c))
        return declined(self, -1);
    if (final > c || hs < 1 || hs > desired || hs > MAX_HAND || head < 0
        || head >= self->nslots || enq < 0 || serial < 0 || serial >= ((int64_t)1 << 31))
        return declined(self, -1);
    if (now > last) {
        if (active && !advance_r(qseats, c, active, now - last, &r))
            return declined(self, -1);
        last = now;
    }
    uint64_t iw, fw = 0;
    int64_t g = w[lb + L_SERVICE_NS];
    if (!exact_seats_ns(initial, g, &iw))
        return declined(self, -1);
    if (final && al && !exact_seats_ns(final, al, &fw))
        return declined(self, -1);
    /* the stats entry must exist already (Python creates it) */
    PyObject *key = PyLong_FromUnsignedLongLong(((uint64_t)serial << 32)
                                                | ((uint64_t)fs_index & 0xFFFFFFFFu));
    if (key == NULL) {
        PyErr_Clear();
        return declined(self, -1);
    }
    PyObject *ebo = PyDict_GetItemWithError(self->stats_at, key);
    Py_DECREF(key);
    int64_t eb;
    if (ebo == NULL || !as_i64(ebo, &eb)) {
        PyErr_Clear();
        return declined(self, -1);
    }
    int64_t sa = self->sb + head * SLOT_WORDS;
    int64_t gen = w[sa + S_GEN] + 1;
    /* every allocation before the first write */
    PyObject *granted = PyList_New(0);
    PyObject *slot_o = PyLong_FromLongLong(head);
    PyObject *gen_o = PyLong_FromLongLong(gen);
    PyObject *res = self->result_type->tp_alloc(self->result_type, 5);
    if (granted == NULL || slot_o == NULL || gen_o == NULL || res == NULL) {
        Py_XDECREF(granted);
        Py_XDECREF(slot_o);
        Py_XDECREF(gen_o);
        Py_XDECREF(res);
        PyErr_Clear();
        return declined(self, -1);
    }
    Py_INCREF(self->execute);
    Py_INCREF(self->empty);
    PyTuple_SET_ITEM(res, 0, self->execute);
    PyTuple_SET_ITEM(res, 1, slot_o);
    PyTuple_SET_ITEM(res, 2, gen_o);
    PyTuple_SET_ITEM(res, 3, self->empty);
    PyTuple_SET_ITEM(res, 4, granted);

    /* the undo log (Ledger._log): the words of this event that are not derived, with their
     * values before; a worker killed from here on is rolled back by the next locker's repair */
    int64_t bw = eb + (ms < 101 ? self->work_at[ms] : self->work_at[101]);
    int64_t *undo = w + self->ub;
    undo[0] = bw;
    undo[1] = w[bw];
    undo[2] = eb + self->e_work_sum;
    undo[3] = w[eb + self->e_work_sum];
    undo[4] = eb + self->e_wait_x;
    undo[5] = w[eb + self->e_wait_x];
    undo[6] = sa + S_STATE;
    undo[7] = w[sa + S_STATE];
    undo[8] = lb + L_DISPATCHED;
    undo[9] = dispatched;
    COMPILER_BARRIER();
    w[H_UNDO_N] = 5; /* the pairs count only from here */
    COMPILER_BARRIER();
    w[bw] += 1;
    w[eb + self->e_work_sum] += ms;
    w[eb + self->e_wait_x] += 1; /* dispatched at arrival: a 0 s wait */
    int64_t q = deal_card(h, desired, enq % hs);
    int64_t qa = self->qb + (qbase + q) * QUEUE_WORDS;
    w[H_FREE_HEAD] = w[sa + S_NEXT];
    w[H_FREE_COUNT] = nfree - 1;
    uint64_t tw = iw + fw;
    int64_t ex = w[qa + Q_EXECUTING];
    uint64_t ndr = ex == 0 ? r : u[qa + Q_NDR];
    if (ndr < r)
        ndr = r;
    integrate(&it, &ix, &ixx, cur, &ilast, now);
    cur = (double)(in_use + sw + ms);
    if (cur < imn)
        imn = cur;
    if (cur > imx)
        imx = cur;
    int64_t held = ms;
    if (ex == 0)
        active += 1;
    w[qa + Q_EXECUTING] = ex + 1;
    w[qa + Q_SEATS] += held;
    if (fair) /* maxmin: the flow's words instead of the queue's */
        g = mm_at_once(self, lb, level, h, head, held, al);
    else
        u[qa + Q_NDR] = ndr + tw;
    int64_t dlen = 0;
    Py_ssize_t blen = PyBytes_GET_SIZE(args[8]);
    if (blen > 0) {
        dlen = blen < self->detail_bytes ? blen : self->detail_bytes;
        memcpy(self->base + self->details + head * self->detail_stride,
               PyBytes_AS_STRING(args[8]), (size_t)dlen);
    }
    w[sa + S_STATE] = ST_EXECUTING;
    w[sa + S_GEN] = gen;
    w[sa + S_OWNER] = owner;
    w[sa + S_LEVEL] = level;
    w[sa + S_QUEUE] = q;
    w[sa + S_PREV] = NIL;
    w[sa + S_NEXT] = NIL;
    w[sa + S_INITIAL] = initial;
    w[sa + S_FINAL] = final;
    w[sa + S_AL] = al;
    w[sa + S_MAX_SEATS] = ms;
    w[sa + S_HELD] = held;
    u[sa + S_INIT_WORK] = iw;
    u[sa + S_FINAL_WORK] = fw;
    u[sa + S_TOTAL_WORK] = tw;
    u[sa + S_ARRIVAL_R] = r;
    w[sa + S_ARRIVAL_NS] = now;
    w[sa + S_START_NS] = now;
    u[sa + S_HASH] = h;
    w[sa + S_FS] = fs_index;
    w[sa + S_SEQ] = enq;
    w[sa + S_DETAIL_LEN] = dlen;
    w[sa + S_STATS] = 2 * eb + (watch ? 1 : 0);
    w[sa + S_SERVICE_NS] = g;
    u[lb + L_R] = r;
    w[lb + L_LAST_NS] = last;
    w[lb + L_EXECUTING] = executing + 1;
    w[lb + L_SEATS_IN_USE] = in_use + held;
    w[lb + L_ACTIVE_QUEUES] = active;
    w[lb + L_QSEATS] = qseats + held;
    f[lb + L_I_T] = it;
    f[lb + L_I_X] = ix;
    f[lb + L_I_XX] = ixx;
    f[lb + L_I_MIN] = imn;
    f[lb + L_I_MAX] = imx;
    f[lb + L_I_CUR] = cur;
    w[lb + L_I_LAST] = ilast;
    if (!fair)
        w[lb + L_ROBIN] = q;
    w[lb + L_ENQUEUES] = enq + 1;
    w[lb + L_DISPATCHED] = dispatched + 1;
    COMPILER_BARRIER();
    w[H_UNDO_N] = 0; /* the event is whole */
    drop_lock(self);
    return res;
}

/* -- finish ------------------------------------------------------------------------------- */

static PyObject *
fp_finish(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t slot, gen, now, dead;
    if (nargs != 3 || !self->have_view)
        Py_RETURN_NONE;
    if (!as_i64(args[0], &slot) || !as_i64(args[1], &gen) || !as_i64(args[2], &now))
        Py_RETURN_NONE;
    if (!take_lock(self, &dead))
        Py_RETURN_NONE;
    int64_t *w = self->w;
    uint64_t *u = self->u;
    double *f = self->f;
    if (dead >= 0 || w[H_DIRTY] || slot < 0 || slot >= self->nslots)
        return declined(self, dead);
    int64_t sa = self->sb + slot * SLOT_WORDS;
    int64_t state = w[sa + S_STATE], sgen = w[sa + S_GEN], owner = w[sa + S_OWNER];
    int64_t level = w[sa + S_LEVEL], q = w[sa + S_QUEUE], initial = w[sa + S_INITIAL];
    int64_t al = w[sa + S_AL], held = w[sa + S_HELD], start = w[sa + S_START_NS];
    int64_t st = w[sa + S_STATS], g = w[sa + S_SERVICE_NS];
    if (sgen != gen || state != ST_EXECUTING || al > 0 || level < 0 || level >= self->nlevels
        || st < 0)
        return declined(self, -1);
    int64_t lb = self->lvb + level * LEVEL_WORDS;
    int64_t quiescing = w[lb + L_QUIESCING], desired = w[lb + L_DESIRED], c = w[lb + L_C];
    int64_t qbase = w[lb + L_QBASE], nq = w[lb + L_NQ], waiting = w[lb + L_WAITING];
    int64_t sw = w[lb + L_SEATS_WAITING];
    uint64_t r = u[lb + L_R];
    int64_t last = w[lb + L_LAST_NS], executing = w[lb + L_EXECUTING];
    int64_t in_use = w[lb + L_SEATS_IN_USE], active = w[lb + L_ACTIVE_QUEUES];
    int64_t qseats = w[lb + L_QSEATS];
    double it = f[lb + L_I_T], ix = f[lb + L_I_X], ixx = f[lb + L_I_XX];
    double imn = f[lb + L_I_MIN], imx = f[lb + L_I_MAX], cur = f[lb + L_I_CUR];
    int64_t ilast = w[lb + L_I_LAST];
    int64_t fair = w[lb + L_FAIRNESS], flow = NIL;
    if (waiting || quiescing || (q != NIL && nq > desired))
        return declined(self, -1);
    if (fair) { /* maxmin: the flow has nothing waiting (none does in the level) */
        if (!self->have_mm || q == NIL)
            return declined(self, -1);
        flow = w[self->xb + slot * XSLOT_WORDS + X_FLOW];
        if (flow < 0 || flow >= self->nslots
            || w[self->fb + flow * FLOW_WORDS + F_WHERE] != FW_NOWHERE)
            return declined(self, -1);
    }
    if (now > last) {
        if (active && !advance_r(qseats, c, active, now - last, &r))
            return declined(self, -1);
        last = now;
    }
    int64_t ran = now - start;
    int64_t hist = (st >> 1) + self->e_exec_r + (st & 1) * self->exec_stride;
    int b = 0;
    while (b < self->ndur && self->dur[b] < ran) /* bisect_left */
        b++;
    uint64_t corr = 0;
    if (q != NIL && !fair && !exact_seats_ns(initial, g - ran, &corr))
        return declined(self, -1);
    PyObject *granted = PyList_New(0);
    PyObject *res = granted ? PyTuple_New(2) : NULL;
    if (res == NULL) {
        Py_XDECREF(granted);
        PyErr_Clear();
        return declined(self, -1);
    }
    PyTuple_SET_ITEM(res, 0, granted);
    PyTuple_SET_ITEM(res, 1, PyLong_FromLong(0)); /* a cached small int: cannot fail */

    w[hist + b] += 1;
    if (ran > 0)
        f[hist + self->nd] += (double)ran / 1e9;
    if (q != NIL) {
        int64_t qa = self->qb + (qbase + q) * QUEUE_WORDS;
        int64_t ex = w[qa + Q_EXECUTING] - 1;
        w[qa + Q_EXECUTING] = ex;
        if (ex == 0)
            active -= 1;
        if (fair)
            mm_finish(self, level, slot, flow, held, ran, g);
        else
            u[qa + Q_NDR] = u[qa + Q_NDR] - corr;
        w[qa + Q_SEATS] -= held;
        qseats -= held;
        if (w[H_SERVICE_ADAPT])
            learn_service(w, lb, ran);
    }
    in_use -= held;
    integrate(&it, &ix, &ixx, cur, &ilast, now);
    cur = (double)(in_use + sw);
    if (cur < imn)
        imn = cur;
    if (cur > imx)
        imx = cur;
    int64_t head = w[H_FREE_HEAD], nfree = w[H_FREE_COUNT];
    w[sa + S_STATE] = ST_FREE;
    w[sa + S_GEN] = gen;
    w[sa + S_OWNER] = owner;
    w[sa + S_LEVEL] = level;
    w[sa + S_QUEUE] = NIL;
    w[sa + S_PREV] = NIL;
    w[sa + S_NEXT] = head;
    w[H_FREE_HEAD] = slot;
    w[H_FREE_COUNT] = nfree + 1;
    u[lb + L_R] = r;
    w[lb + L_LAST_NS] = last;
    w[lb + L_EXECUTING] = executing - 1;
    w[lb + L_SEATS_IN_USE] = in_use;
    w[lb + L_ACTIVE_QUEUES] = active;
    w[lb + L_QSEATS] = qseats;
    f[lb + L_I_T] = it;
    f[lb + L_I_X] = ix;
    f[lb + L_I_XX] = ixx;
    f[lb + L_I_MIN] = imn;
    f[lb + L_I_MAX] = imx;
    f[lb + L_I_CUR] = cur;
    w[lb + L_I_LAST] = ilast;
    drop_lock(self);
    return res;
}

/* -- the object ----------------------------------------------------------------------------- */

/* -- the calls with their hand-over ------------------------------------------------------ */

#define MAX_RESUME_ARGS 15

static PyObject *
resume(FastPath *self, PyObject *fn, PyObject *decline, PyObject *const *args,
       Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *stack[MAX_RESUME_ARGS + 1];
    Py_ssize_t n = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    if (fn == NULL || n > MAX_RESUME_ARGS) {
        if (PyLong_Check(decline))  /* the lock is held: give it back */
            abandon_lock(self, PyLong_AsLongLong(decline));
        if (fn == NULL)
            PyErr_SetString(PyExc_RuntimeError, "the ledger is closed");
        else
            PyErr_SetString(PyExc_TypeError, "too many arguments");
        return NULL;
    }
    stack[0] = decline;
    memcpy(stack + 1, args, n * sizeof(PyObject *));
    return PyObject_Vectorcall(fn, stack, nargs + 1, kwnames);
}

/* ``core``'s result when it is a ``done`` (the operation completed), else ``fn``'s */
static PyObject *
call_or_resume(FastPath *self, PyObject *(*core)(FastPath *, PyObject *const *, Py_ssize_t),
               PyTypeObject *done, PyObject *fn, PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames)
{
    PyObject *res;
    if (kwnames == NULL) {
        res = core(self, args, nargs);
        if (res == NULL || Py_IS_TYPE(res, done))
            return res;
    }
    else
        res = Py_NewRef(Py_None);
    PyObject *out = resume(self, fn, res, args, nargs, kwnames);
    Py_DECREF(res);
    return out;
}

static PyObject *
fp_admit_call(FastPath *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return call_or_resume(self, fp_admit, self->result_type, self->admit_resume, args, nargs,
                          kwnames);
}

static PyObject *
fp_finish_call(FastPath *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return call_or_resume(self, fp_finish, &PyTuple_Type, self->finish_resume, args, nargs,
                          kwnames);
}

static PyObject *
fp_set_resume(FastPath *self, PyObject *args)
{
    PyObject *a, *f;
    if (!PyArg_ParseTuple(args, "OO", &a, &f))
        return NULL;
    Py_XSETREF(self->admit_resume, Py_NewRef(a));
    Py_XSETREF(self->finish_resume, Py_NewRef(f));
    Py_RETURN_NONE;
}

static PyObject *
fp_set_maxmin(FastPath *self, PyObject *args)
{
    long long mmb, fhb, fb, ib, imask, xb;
    if (!PyArg_ParseTuple(args, "LLLLLL", &mmb, &fhb, &fb, &ib, &imask, &xb))
        return NULL;
    if (imask < 0 || (imask & (imask + 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "set_maxmin: the index mask is not 2**k - 1");
        return NULL;
    }
    self->mmb = mmb;
    self->fhb = fhb;
    self->fb = fb;
    self->ib = ib;
    self->imask = (uint64_t)imask;
    self->xb = xb;
    self->have_mm = 1;
    Py_RETURN_NONE;
}

static int
fill_i64(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what)
{
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected a tuple of %zd ints", what, n);
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
        if (out[i] == -1 && PyErr_Occurred())
            return 0;
    }
    return 1;
}

static int
fp_init(FastPath *self, PyObject *args, PyObject *kwds)
{
    PyObject *buf, *stats_at, *result_type, *execute, *consts;
    PyObject *work_at, *dur;
    int lock_mode;
    long long pid;
    static char *kwlist[] = {"buffer", "lock_mode", "pid",
                             "stats_at", "result_type", "execute", "consts", "work_at",
                             "dur", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiLO!O!UOOO", kwlist, &buf, &lock_mode, &pid,
                                     &PyDict_Type, &stats_at, &PyType_Type, &result_type,
                                     &execute, &consts, &work_at, &dur))
        return -1;
    if (!PyType_IsSubtype((PyTypeObject *)result_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "result_type must be a tuple subclass");
        return -1;
    }
    int64_t c[14];
    if (!fill_i64(consts, c, 14, "consts") || !fill_i64(work_at, self->work_at, 102, "work_at"))
        return -1;
    if (!PyTuple_Check(dur) || PyTuple_GET_SIZE(dur) > MAX_DUR) {
        PyErr_SetString(PyExc_ValueError, "dur: a tuple of at most 64 bounds");
        return -1;
    }
    self->ndur = (int)PyTuple_GET_SIZE(dur);
    if (!fill_i64(dur, self->dur, self->ndur, "dur"))
        return -1;
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    self->have_view = 1;
    self->base = (char *)self->view.buf;
    self->w = (int64_t *)self->view.buf;
    self->u = (uint64_t *)self->view.buf;
    self->f = (double *)self->view.buf;
    self->mutex = (pthread_mutex_t *)(self->base + H_MUTEX * 8);
    self->lock_mode = lock_mode;
    self->pid = pid;
    Py_INCREF(stats_at);
    self->stats_at = stats_at;
    Py_INCREF(result_type);
    self->result_type = (PyTypeObject *)result_type;
    Py_INCREF(execute);
    self->execute = execute;
    self->empty = PyUnicode_FromString("");
    if (self->empty == NULL)
        return -1;
    self->lvb = c[0];
    self->qb = c[1];
    self->sb = c[2];
    self->nlevels = c[3];
    self->nslots = c[4];
    self->details = c[5];
    self->detail_stride = c[6];
    self->detail_bytes = c[7];
    self->e_work_sum = c[8];
    self->e_wait_x = c[9];
    self->e_exec_r = c[10];
    self->exec_stride = c[11];
    self->nd = c[12];
    self->ub = c[13];
    return 0;
}

static PyObject *
fp_close(FastPath *self, PyObject *Py_UNUSED(ignored))
{
    if (self->have_view) {
        self->have_view = 0;
        PyBuffer_Release(&self->view);
    }
    Py_CLEAR(self->admit_resume);
    Py_CLEAR(self->finish_resume);
    Py_RETURN_NONE;
}

static int
fp_traverse(FastPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->admit_resume);
    Py_VISIT(self->finish_resume);
    Py_VISIT(self->stats_at);
    return 0;
}

static int
fp_clear(FastPath *self)
{
    Py_CLEAR(self->admit_resume);
    Py_CLEAR(self->finish_resume);
    return 0;
}

static void
fp_dealloc(FastPath *self)
{
    PyObject_GC_UnTrack(self);
    fp_clear(self);
    if (self->have_view)
        PyBuffer_Release(&self->view);
    Py_XDECREF(self->stats_at);
    Py_XDECREF((PyObject *)self->result_type);
    Py_XDECREF(self->execute);
    Py_XDECREF(self->empty);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef fp_methods[] = {
    {"admit", (PyCFunction)(void (*)(void))fp_admit, METH_FASTCALL,
     "admit(level, flow_hash, initial, final, al, owner, now, fs_index, detail, watch)"},
    {"finish", (PyCFunction)(void (*)(void))fp_finish, METH_FASTCALL,
     "finish(slot, gen, now)"},
    {"admit_call", (PyCFunction)(void (*)(void))fp_admit_call, METH_FASTCALL | METH_KEYWORDS,
     "admit, handing a decline to the admit resume function"},
    {"finish_call", (PyCFunction)(void (*)(void))fp_finish_call, METH_FASTCALL | METH_KEYWORDS,
     "finish, handing a decline to the finish resume function"},
    {"set_resume", (PyCFunction)fp_set_resume, METH_VARARGS,
     "set_resume(admit_resume, finish_resume)"},
    {"set_maxmin", (PyCFunction)fp_set_maxmin, METH_VARARGS,
     "set_maxmin(maxmin_base, flow_header, flow_base, flow_index, index_mask, xslot_base)"},
    {"mm_heap_insert", (PyCFunction)(void (*)(void))fp_mm_heap_insert, METH_FASTCALL,
     "mm_heap_insert(mm, f): flowheap.FlowHeap._heap_insert"},
    {"mm_heap_remove", (PyCFunction)(void (*)(void))fp_mm_heap_remove, METH_FASTCALL,
     "mm_heap_remove(mm, f): flowheap.FlowHeap._heap_remove"},
    {"mm_heap_decrease", (PyCFunction)(void (*)(void))fp_mm_heap_decrease, METH_FASTCALL,
     "mm_heap_decrease(mm, f): flowheap.FlowHeap._heap_decrease"},
    {"mm_get", (PyCFunction)(void (*)(void))fp_mm_get, METH_FASTCALL,
     "mm_get(mm, level, flow_hash) -> f: flowtable.FlowTable._get"},
    {"close", (PyCFunction)fp_close, METH_NOARGS, "Release the buffer."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "apf_gunicorn.ledger._fastpath.FastPath",
    .tp_basicsize = sizeof(FastPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)fp_traverse,
    .tp_clear = (inquiry)fp_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "The ledger's admit/finish fast paths over one ledger buffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fp_init,
    .tp_dealloc = (destructor)fp_dealloc,
    .tp_methods = fp_methods,
};

/* wait_unlocked(address) -> int: block, without the GIL, until the process-shared mutex at
 * ``address`` is free; ``ProcessLock``'s contended path. Returns 0 when it was free (and is
 * NOT held: take it with trylock, the GIL held), EOWNERDEAD when its holder died (it IS held
 * now, inconsistent: the caller repairs), or another pthread error. Locking and unlocking
 * here, rather than returning with the mutex held, keeps the mutex from being held while
 * this thread waits for the GIL: milliseconds, during which every other worker would wait. */
static PyObject *
mod_wait_unlocked(PyObject *mod, PyObject *arg)
{
    void *addr = PyLong_AsVoidPtr(arg);
    if (addr == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "wait_unlocked: null address");
        return NULL;
    }
    pthread_mutex_t *m = (pthread_mutex_t *)addr;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_mutex_lock(m);
    if (rc == 0)
        pthread_mutex_unlock(m);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef module_methods[] = {
    {"wait_unlocked", (PyCFunction)mod_wait_unlocked, METH_O,
     "wait_unlocked(address) -> 0 (free, not held), EOWNERDEAD (held) or an error"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "_fastpath", "The seat ledger's per-request fast paths in C.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    if (PyType_Ready(&FastPathType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&fastpath_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FastPathType);
    if (PyModule_AddObject(m, "FastPath", (PyObject *)&FastPathType) < 0) {
        Py_DECREF(&FastPathType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *mm_layout = Py_BuildValue(
        "(iiiii(iiii)(iiiiiiiiiiiiiiii)(ii)(ii)(ii))", L_FAIRNESS, MM_WORDS, M_V, M_SEQ, M_NFLOWS,
        FH_FREE, FH_IDLE_HEAD, FH_IDLE_TAIL, FH_EVICTIONS,
        FLOW_WORDS, F_LEVEL, F_HASH, F_TAG, F_SEQ, F_WAITING, F_EXEC, F_SEATS, F_HEAD, F_TAIL,
        F_EST, F_N, F_WHERE, F_CHILD, F_NEXT, F_PREV, FW_NOWHERE, FW_IDLE, XSLOT_WORDS, X_FLOW,
        M_ROOT, FW_HEAP);
    if (mm_layout == NULL || PyModule_AddObject(m, "LAYOUT_MAXMIN", mm_layout) < 0) {
        Py_XDECREF(mm_layout);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *layout = Py_BuildValue(
        "(iiiiiiii(iiiiiiiiiiiiiiiiiiiiiiiiii)(iii)(iiiiiiiiiiiiiiiiiiiiiii)iii(iiii)i)",
        H_FREE_HEAD, H_FREE_COUNT, H_HOLDER_PID, H_DIRTY, H_MUTEX, LEVEL_WORDS, QUEUE_WORDS,
        SLOT_WORDS,
        L_USED, L_QUIESCING, L_DESIRED, L_HAND, L_C, L_QBASE, L_NQ, L_SERIAL, L_WAITING,
        L_SEATS_WAITING, L_R, L_LAST_NS, L_EXECUTING, L_SEATS_IN_USE, L_ACTIVE_QUEUES,
        L_QSEATS, L_I_T, L_I_X, L_I_XX, L_I_MIN, L_I_MAX, L_I_CUR, L_I_LAST, L_ROBIN,
        L_ENQUEUES, L_DISPATCHED,
        Q_NDR, Q_EXECUTING, Q_SEATS,
        S_STATE, S_GEN, S_OWNER, S_LEVEL, S_QUEUE, S_PREV, S_NEXT, S_INITIAL, S_FINAL, S_AL,
        S_MAX_SEATS, S_HELD, S_INIT_WORK, S_FINAL_WORK, S_TOTAL_WORK, S_ARRIVAL_R,
        S_ARRIVAL_NS, S_START_NS, S_HASH, S_FS, S_SEQ, S_DETAIL_LEN, S_STATS,
        ST_FREE, ST_EXECUTING, NIL, H_SERVICE_ADAPT, L_SERVICE_NS, L_SERVICE_N,
        S_SERVICE_NS, H_UNDO_N);
    if (layout == NULL || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "LAYOUT_DIGEST", LAYOUT_DIGEST) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
