/* aruntime's native core: timeline signals, loop notifiers and one command processor per queue.
 *
 * Nothing here touches Python: Python calls these functions through ctypes (which releases the GIL for
 * the duration of each call) and reads signal values straight from their memory.
 *
 * Signals. A signal is a 64-bit counter that only grows. Threads wait on it with a timeout (a condition
 * variable); event loops arm it: "write my notifier once the value reaches v". Setting the value wakes the
 * blocked threads and writes the file descriptor of every notifier whose armed value was reached, at most
 * once until that notifier acknowledges (so a burst of completions costs a loop one wake-up).
 *
 * Engines. An engine owns an unbounded single-producer queue of fixed-size command records (a linked list of
 * chunks) and a worker: a thread of its own, or one of the shared workers (see below). The worker runs
 * wait / signal / timestamp / copy / exec / check / python commands in order; the last command of an op carries
 * END and sets the engine's timeline signal to the op's value. A failing command is logged (op value, command index, kind, code) before that value is
 * set, and the op's remaining commands are skipped except its signals. "python" commands are handed to a
 * Python thread of the engine's own (ar_py_next / ar_py_done) while the worker waits: the worker never
 * runs Python and never needs the GIL.
 *
 * Priorities. A normal engine may name a high-priority sibling (ar_engine_yield_to): at each op boundary, before
 * it takes its next op, its worker sleeps (on the sibling's timeline, a short while at a time) as long as the
 * sibling has records not yet taken and is not blocked in a wait for another queue (that wait may be for this
 * very engine). An op that runs is never interrupted, and an op the sibling runs with nothing queued behind it
 * runs alongside this engine's next one, each on a core of its own where there are spare ones.
 *
 * Shared workers. An engine made with `workers` > 0 has no thread of its own: a process-wide set of that many
 * worker threads (started with the first such engine) serves every such engine's queue, one worker at a time,
 * in the order the queues got work they can run (a ready list). A worker runs a queue's records until it is
 * empty, its next record waits for a signal not yet reached (the queue is parked: the signal reaching the value
 * puts it back on the ready list, or a worker does once the wait's timeout has passed), or, at an op boundary,
 * another queue is ready and no other worker is free to take it (it goes to the back of the list). A wait counts
 * as run time of its op, as on a thread of its own. So a process with as many workers as
 * CPUs never has more of them runnable than CPUs, whatever the number of queues, and a device's copy and its
 * kernel may run one after the other on the same worker.
 *
 * Pending ops. An op that must wait for ops of other queues is handed to the core with what it waits for
 * (signal values, or other pending ops); the thread that meets the last of them appends it to its queue's
 * ring (see "pending ops" below), so no Python and no event loop run between a producer's end and its
 * consumer's start, and later independent work on the consumer's queue is never stuck behind it.
 *
 * Guarded copies. Every copy the core makes is guarded against the SIGBUS of a file-backed page that is gone (see
 * "guarded copies" below): it fails, logged like any failed command, instead of killing the process.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define AR_VERSION 5
#define MAXN 64       /* notifiers (event loops waiting at once) */
#define CHUNK 256     /* command records per queue chunk */
#define NEVER UINT64_MAX
#define YIELD_NS 50000 /* how long a worker letting its high-priority sibling go first sleeps before it looks again */
#define ABANDONED (1ull << 63) /* the value a pending op gets when its engine had stopped */
#define TAG (1ull << 63)       /* in a K_CHECK pair's value: the value is read from the cell at this address */

enum { K_WAIT, K_SIGNAL, K_TIMESTAMP, K_COPY, K_EXEC, K_NOP, K_CHECK, K_PY, K_STOP };
enum { F_END = 1, F_RECORD = 2 };
enum { E_KERNEL = 1, E_TIMEOUT = 2, E_PYTHON = 3, E_ORDER = 4, E_SKIPPED = 5, E_DEADLINE = 6, E_FAULT = 7 };

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- notifiers ------------------------------------------------------------------------------------ */

typedef struct {
  int used;
  int fd;         /* written to wake the loop */
  int is_eventfd; /* eventfd: 8 bytes; else a pipe: 1 byte */
  _Atomic int pending;
  uint64_t *handed; /* the cells of pending ops handed on that the consumer asked about (ar_pend_notify) */
  size_t nhanded, caphanded;
  int handed_lost;  /* a note could not be kept (no memory): the consumer looks at every op it asked about */
} notifier;

static notifier notifiers[MAXN];
static pthread_mutex_t notifiers_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct ar_sig ar_sig;
struct ar_sig {
  _Atomic uint64_t value; /* first: Python reads it at the signal's address */
  _Atomic uint64_t armed; /* the least value any notifier waits for (NEVER: none) */
  _Atomic int blocked;    /* threads in ar_sig_wait */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  uint64_t arm[MAXN];
  ar_sig *prev, *next; /* every live signal, to disarm a notifier that goes away */
  _Atomic uint64_t setting;   /* the greatest value a set() has begun with (watchers fire before it is published) */
  _Atomic uint64_t watch_min; /* the least value a pending op waits for (NEVER: none) */
  struct watch *watches;      /* under lock */
};

typedef struct pend pend;
typedef struct watch {
  uint64_t v;
  pend *p;
  struct watch *next;
} watch;

static void watches_fire(ar_sig *s, uint64_t v);
static void watches_drop(ar_sig *s);
static _Atomic int parked_queues; /* queues of the shared workers parked on a wait (see "shared workers") */
typedef struct ar_engine ar_engine;
void ar_py_stop(ar_engine *e);
static void unpark(ar_sig *s, uint64_t v);

static ar_sig *all_sigs;
static pthread_mutex_t sigs_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pend_lock = PTHREAD_MUTEX_INITIALIZER; /* pending ops: see below */

int ar_version(void) { return AR_VERSION; }

/* Write notifier n's descriptor unless a write is already pending. */
void ar_notify(int n) {
  if (n < 0 || n >= MAXN) return;
  notifier *nt = &notifiers[n];
  if (atomic_exchange(&nt->pending, 1)) return;
  pthread_mutex_lock(&notifiers_lock); /* against ar_notifier_free: never write a descriptor being closed */
  if (nt->used) {
    uint64_t one = 1;
    ssize_t r = write(nt->fd, &one, nt->is_eventfd ? 8 : 1);
    (void)r;
  }
  pthread_mutex_unlock(&notifiers_lock);
}

/* Note, for notifier n's consumer, that the pending op whose cell is `cell` was handed on (it reads the notes
 * with ar_notifier_handed). Without memory for the note, a 0 note tells it to look at every op it asked about. */
static void note_handed(int n, uint64_t *cell) {
  pthread_mutex_lock(&notifiers_lock);
  notifier *nt = &notifiers[n];
  if (nt->used) {
    if (nt->nhanded == nt->caphanded) {
      size_t cap = nt->caphanded ? 2 * nt->caphanded : 64;
      uint64_t *grown = realloc(nt->handed, cap * sizeof(uint64_t));
      if (grown) {
        nt->handed = grown;
        nt->caphanded = cap;
      }
    }
    if (nt->nhanded < nt->caphanded) nt->handed[nt->nhanded++] = (uint64_t)(uintptr_t)cell;
    else nt->handed_lost = 1;
  }
  pthread_mutex_unlock(&notifiers_lock);
}

/* Move up to max notes of notifier n (cell addresses; 0: look at every op asked about) into out: how many. */
size_t ar_notifier_handed(int n, uint64_t *out, size_t max) {
  if (n < 0 || n >= MAXN) return 0;
  pthread_mutex_lock(&notifiers_lock);
  notifier *nt = &notifiers[n];
  size_t k = 0;
  if (nt->handed_lost && max) {
    out[k++] = 0;
    nt->handed_lost = 0;
  }
  size_t from = nt->nhanded < max - k ? nt->nhanded : max - k;
  if (from) memcpy(out + k, nt->handed, from * sizeof(uint64_t));
  memmove(nt->handed, nt->handed + from, (nt->nhanded - from) * sizeof(uint64_t));
  nt->nhanded -= from;
  pthread_mutex_unlock(&notifiers_lock);
  return k + from;
}

int ar_notifier_new(int fd, int is_eventfd) {
  pthread_mutex_lock(&notifiers_lock);
  int found = -1;
  for (int i = 0; i < MAXN && found < 0; i++)
    if (!notifiers[i].used) found = i;
  if (found >= 0) {
    notifiers[found].is_eventfd = is_eventfd;
    atomic_store(&notifiers[found].pending, 0);
    notifiers[found].fd = fd;
    notifiers[found].used = 1;
  }
  pthread_mutex_unlock(&notifiers_lock);
  return found;
}

static void recompute_armed(ar_sig *s) {
  uint64_t least = NEVER;
  for (int i = 0; i < MAXN; i++)
    if (s->arm[i] < least) least = s->arm[i];
  atomic_store(&s->armed, least);
}

/* Release slot n: no signal writes its descriptor afterwards (the caller closes it). */
void ar_notifier_free(int n) {
  if (n < 0 || n >= MAXN) return;
  pthread_mutex_lock(&sigs_lock);
  for (ar_sig *s = all_sigs; s; s = s->next) {
    pthread_mutex_lock(&s->lock);
    if (s->arm[n] != NEVER) {
      s->arm[n] = NEVER;
      recompute_armed(s);
    }
    pthread_mutex_unlock(&s->lock);
  }
  pthread_mutex_unlock(&sigs_lock);
  pthread_mutex_lock(&notifiers_lock);
  notifiers[n].used = 0;
  notifiers[n].nhanded = 0;
  notifiers[n].handed_lost = 0;
  pthread_mutex_unlock(&notifiers_lock);
}

/* The loop read its descriptor: later reached values write it again. A full barrier, so the signal
 * values the loop reads next are at least as new as this acknowledgement. */
void ar_notifier_ack(int n) {
  if (n < 0 || n >= MAXN) return;
  atomic_exchange(&notifiers[n].pending, 0);
}

/* ---- signals -------------------------------------------------------------------------------------- */

/* s's lock, and its condition on the monotonic clock (as its waits time out) */
static void sig_sync_init(ar_sig *s) {
  pthread_mutex_init(&s->lock, NULL);
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cond, &attr);
  pthread_condattr_destroy(&attr);
}

ar_sig *ar_sig_new(uint64_t value) {
  ar_sig *s = NULL;
  if (posix_memalign((void **)&s, 64, sizeof(ar_sig)) != 0) return NULL;
  memset(s, 0, sizeof(*s));
  atomic_store(&s->value, value);
  atomic_store(&s->armed, NEVER);
  atomic_store(&s->watch_min, NEVER);
  for (int i = 0; i < MAXN; i++) s->arm[i] = NEVER;
  sig_sync_init(s);
  pthread_mutex_lock(&sigs_lock);
  s->next = all_sigs;
  if (all_sigs) all_sigs->prev = s;
  all_sigs = s;
  pthread_mutex_unlock(&sigs_lock);
  return s;
}

void ar_sig_free(ar_sig *s) {
  if (!s) return;
  pthread_mutex_lock(&sigs_lock);
  if (s->prev) s->prev->next = s->next;
  else all_sigs = s->next;
  if (s->next) s->next->prev = s->prev;
  pthread_mutex_unlock(&sigs_lock);
  watches_drop(s);
  pthread_mutex_destroy(&s->lock);
  pthread_cond_destroy(&s->cond);
  free(s);
}

/* Advance s to v (> its value): wake blocked threads and the notifiers armed at or below v.
 * Returns 0, or -1 if v would not advance it. */
int ar_sig_set(ar_sig *s, uint64_t v) {
  uint64_t old = atomic_load(&s->value);
  if (v <= old) return -1;
  uint64_t began = atomic_load(&s->setting);
  while (began < v && !atomic_compare_exchange_weak(&s->setting, &began, v)) {
  }
  if (atomic_load(&s->watch_min) <= v) watches_fire(s, v); /* before the value is published: see pend */
  do {
    if (v <= old) return -1;
  } while (!atomic_compare_exchange_weak(&s->value, &old, v));
  if (atomic_load(&parked_queues)) unpark(s, v); /* the queues parked on a wait it meets go on */
  if (atomic_load(&s->blocked)) { /* as in append: signalled once the lock is free */
    pthread_mutex_lock(&s->lock);
    pthread_mutex_unlock(&s->lock);
    pthread_cond_broadcast(&s->cond);
  }
  if (v >= atomic_load(&s->armed)) {
    int fire[MAXN], nfire = 0;
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < MAXN; i++) {
      if (s->arm[i] <= v) {
        s->arm[i] = NEVER;
        fire[nfire++] = i;
      }
    }
    recompute_armed(s);
    pthread_mutex_unlock(&s->lock);
    for (int i = 0; i < nfire; i++) ar_notify(fire[i]);
  }
  return 0;
}

/* Ask notifier n to be written once s reaches v. Returns 1 if it already has (nothing is armed then). */
int ar_sig_arm(ar_sig *s, int n, uint64_t v) {
  if (n < 0 || n >= MAXN) return -1;
  pthread_mutex_lock(&s->lock);
  uint64_t cur = s->arm[n];
  if (v < cur || cur <= atomic_load(&s->value)) { /* an arm already reached is stale: a set() fires it now */
    s->arm[n] = v;
    recompute_armed(s);
  }
  pthread_mutex_unlock(&s->lock);
  if (atomic_load(&s->value) >= v) { /* set() may have run before the arm was visible: check again */
    pthread_mutex_lock(&s->lock);
    if (s->arm[n] <= atomic_load(&s->value)) {
      s->arm[n] = NEVER;
      recompute_armed(s);
    }
    pthread_mutex_unlock(&s->lock);
    return 1;
  }
  return 0;
}

/* Block until s reaches v: 0 once it has, 1 after timeout_ns (< 0: no limit). */
int ar_sig_wait(ar_sig *s, uint64_t v, int64_t timeout_ns) {
  if (atomic_load(&s->value) >= v) return 0;
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  if (timeout_ns >= 0) {
    int64_t ns = deadline.tv_nsec + timeout_ns % 1000000000;
    deadline.tv_sec += timeout_ns / 1000000000 + ns / 1000000000;
    deadline.tv_nsec = ns % 1000000000;
  }
  int result = 0;
  pthread_mutex_lock(&s->lock);
  atomic_fetch_add(&s->blocked, 1);
  while (atomic_load(&s->value) < v) {
    int rc = timeout_ns >= 0 ? pthread_cond_timedwait(&s->cond, &s->lock, &deadline)
                             : pthread_cond_wait(&s->cond, &s->lock);
    if (rc == ETIMEDOUT && atomic_load(&s->value) < v) {
      result = 1;
      break;
    }
  }
  atomic_fetch_sub(&s->blocked, 1);
  pthread_mutex_unlock(&s->lock);
  return result;
}

/* ---- completions from driver threads ---------------------------------------------------------------- */

/* What a driver callback completes: set sig to value. Made by Python (ar_completion_new), freed by the
 * callback that runs it, so a backend hands one to the driver per completion it asks for. */
typedef struct {
  ar_sig *sig;
  uint64_t value;
} ar_completion;

ar_completion *ar_completion_new(ar_sig *sig, uint64_t value) {
  ar_completion *c = malloc(sizeof(ar_completion));
  if (c) {
    c->sig = sig;
    c->value = value;
  }
  return c;
}

/* A host function for a driver stream (CUDA's cuLaunchHostFunc: void (*)(void *)): sets the signal, which
 * writes the notifiers of the loops waiting for it. Runs no Python. */
void ar_completion_host_fn(void *arg) {
  ar_completion *c = arg;
  ar_sig_set(c->sig, c->value);
  free(c);
}

/* An event callback (OpenCL's clSetEventCallback: void (*)(cl_event, cl_int, void *)). */
void ar_completion_event_fn(void *event, int32_t status, void *arg) {
  (void)event;
  (void)status;
  ar_completion_host_fn(arg);
}

/* ---- guarded copies ----------------------------------------------------------------------------------- */

/* A DISK buffer is a shared mapping of its file. Where another process truncates the file, the pages past its new
 * end are gone, and the next access to one of them raises SIGBUS, which kills the process. So every copy the core
 * makes (K_COPY, and ar_copy, which the Python side calls through ctypes) is guarded, as the JVM guards the accesses
 * of a MappedByteBuffer: the copying thread arms a thread-local jump buffer around its memmove, and a SIGBUS
 * handler, installed once (at the first copy), jumps back out of a fault at an address inside the copy's source or
 * destination; the copy then reports which of them faulted. Any other SIGBUS goes to the handler that was there
 * before (Python's faulthandler, or the default action: the process ends as it would have).
 *
 * Why not pread/pwrite on the file instead: the core sees addresses (of the mapping), not the file and the offset
 * behind them; a device's file descriptor is closed when it closes while its mappings stay valid; and a copy between
 * a file and host memory, between two files, or between two views of one file would each need a path of its own.
 * Arming the guard is a sigsetjmp that saves no signal mask (under 10 ns a copy, no system call), so every copy
 * pays it and stays one memmove at memory speed, whatever the memory at either end.
 *
 * A handler installed after ours (Python's faulthandler enabled after the first copy) sees the fault first: it
 * reports it, puts ours back and raises SIGBUS again, which ours lets pass while a copy is guarded, so the access
 * faults again and the copy fails as it should (after that report).
 *
 * What the guard cannot cover: bytes of a mapping read or written outside the core's copies (a zero-copy
 * memoryview, a DLPack export, a kernel, a driver reading host memory itself). */

enum { FAULT_SOURCE = 1, FAULT_DESTINATION = 2 };

typedef struct {
  sigjmp_buf jump;
  uintptr_t dst, src, n;
  volatile int side; /* set by the handler before it jumps */
} copy_guard;

/* The guard of the copy this thread is making (NULL: none). Initial-exec: the handler reads it without a call that
 * could allocate the thread's block of thread-locals. */
static __thread copy_guard *volatile guarding __attribute__((tls_model("initial-exec")));
static struct sigaction bus_before; /* the SIGBUS disposition before ours, which a fault not ours goes to */
static pthread_once_t bus_once = PTHREAD_ONCE_INIT;

static void on_bus(int sig, siginfo_t *info, void *context) {
  copy_guard *g = guarding;
  if (g) {
    if (info->si_code <= 0) return; /* sent, not a fault (faulthandler re-raising it): the access faults again */
    uintptr_t at = (uintptr_t)info->si_addr;
    int side = at - g->src < g->n ? FAULT_SOURCE : at - g->dst < g->n ? FAULT_DESTINATION : 0;
    if (side) {
      guarding = NULL;
      g->side = side;
      siglongjmp(g->jump, 1);
    }
  }
  if (bus_before.sa_flags & SA_SIGINFO) {
    bus_before.sa_sigaction(sig, info, context);
  } else if (bus_before.sa_handler != SIG_DFL && bus_before.sa_handler != SIG_IGN) {
    bus_before.sa_handler(sig);
  } else { /* the default action: a fault repeats once this returns, a sent signal is sent again */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &dfl, NULL);
    if (info->si_code <= 0) raise(SIGBUS);
  }
}

static void bus_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_bus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER; /* NODEFER: the jump out leaves the signal mask as it was */
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGBUS, NULL, &bus_before) == 0) sigaction(SIGBUS, &sa, NULL);
}

/* memmove(dst, src, n), guarded: 0 once copied, or FAULT_SOURCE / FAULT_DESTINATION where a page of that side
 * faulted (the copy stopped there: the destination holds part of the bytes). */
static int guarded_copy(void *dst, const void *src, size_t n) {
  if (!n) return 0;
  pthread_once(&bus_once, bus_install);
  copy_guard g;
  g.dst = (uintptr_t)dst;
  g.src = (uintptr_t)src;
  g.n = n;
  g.side = 0;
  if (sigsetjmp(g.jump, 0)) {
    sigset_t bus; /* unblocked in case a handler ahead of ours ran without NODEFER */
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
    return g.side;
  }
  guarding = &g;
  atomic_signal_fence(memory_order_seq_cst);
  memmove(dst, src, n);
  atomic_signal_fence(memory_order_seq_cst);
  guarding = NULL;
  return 0;
}

/* The guarded copy for Python's own copies (the Python engine's, a DISK allocator's): see guarded_copy. */
int ar_copy(void *dst, const void *src, size_t n) { return guarded_copy(dst, src, n); }

/* ---- engines -------------------------------------------------------------------------------------- */

typedef struct {
  uint32_t kind, flags;
  uint64_t a, b, c, d;
  uint64_t value; /* the op's value on the engine's timeline */
  uint64_t op;    /* the op's id, for profile ranges */
  uint32_t name;  /* profile name id */
  uint32_t index; /* the command's index within its op */
  int64_t t;      /* when it was appended to the ring (ns), for the queue-time histogram */
} ar_cmd;

/* ---- metrics: cheap histograms of nanoseconds, 8 buckets per power of two (within 12.5%) ------------------ */

#define HIST 496
static unsigned bucket(int64_t ns) {
  if (ns < 8) return ns < 0 ? 0 : (unsigned)ns;
  unsigned msb = 63u - (unsigned)__builtin_clzll((uint64_t)ns);
  return (msb - 2) * 8 + (unsigned)((ns >> (msb - 3)) & 7);
}

typedef struct chunk {
  ar_cmd cmds[CHUNK];
  struct chunk *_Atomic next;
} chunk;

typedef struct {
  uint64_t value;
  uint32_t index, kind;
  int64_t code;
} failure;

typedef struct {
  int64_t start, end;
  uint64_t op;
  uint64_t name;
} range_rec;

typedef struct ar_engine {
  ar_sig *timeline;
  _Atomic uint64_t last_failed; /* the greatest value of an op that failed (0: none) */
  _Atomic uint64_t fail_count;
  _Atomic uint64_t range_count;
  _Atomic uint64_t last; /* the value of the op appended last */
  _Atomic int64_t tid;   /* the worker's thread id (for its CPU affinity), set before ar_engine_new returns */
  _Atomic uint64_t skipped; /* ops skipped by their gate */
  /* metrics, written by the worker only (Python reads them as they are: counts, not a snapshot) */
  _Atomic uint64_t taken; /* the value of the op the worker took last */
  _Atomic uint64_t busy_ns; /* time spent in ops done, from their first record to their last */
  _Atomic int64_t taken_at; /* when the worker took the op it runs (0: it runs none) */
  _Atomic uint64_t queued_hist[HIST]; /* appended -> taken by the worker */
  _Atomic uint64_t run_hist[HIST];    /* taken -> done */
  /* producers: Python's submissions and pending ops handed on by whichever thread met their last condition */
  pthread_mutex_t submit_lock;
  int stopped;
  chunk *tail;
  unsigned tail_pos;
  _Atomic uint64_t published;
  /* consumer */
  chunk *head;
  unsigned head_pos;
  _Atomic uint64_t consumed; /* written by the worker only; read by a normal engine yielding to this one */
  _Atomic int waiting;       /* the worker is blocked in a wait command */
  struct ar_engine *_Atomic high; /* the high-priority engine this one lets go first (NULL: none) */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  _Atomic int sleeping;
  int64_t spin_ns;            /* the longest the worker polls for work before it sleeps (0: it never polls) */
  _Atomic int64_t spin_now;   /* how long it polls now: grown while work comes soon after it ran out, else shrunk */
  int metrics; /* keep the clock-based metrics (set once, before the first submission) */
  /* failures and ranges, drained by Python */
  pthread_mutex_t log_lock;
  failure *fails;
  size_t nfails, capfails;
  range_rec *ranges;
  size_t nranges, capranges;
  /* python commands */
  pthread_mutex_t py_lock;
  pthread_cond_t py_cond;
  int py_state; /* 0 idle, 1 request posted, 2 taken, 3 answered */
  uint64_t py_value;
  uint32_t py_index;
  int py_rc;
  int py_stop;
  pthread_t thread;
  int started, joined;
  /* the state of the op the worker runs, kept with the queue (a shared worker may carry on where another left) */
  uint64_t skipping; /* the value of an op whose rest is skipped after a failure */
  uint64_t current;  /* the value of the op being run */
  int64_t taken_t;   /* when the worker took it */
  int boundary;      /* the next record starts an op */
  /* shared workers (see above) */
  int shared;
  _Atomic int run_state;        /* R_IDLE, R_QUEUED, R_RUNNING, R_PARKED: under pool.lock (read outside it) */
  struct ar_engine *next_ready; /* on the ready list or the parked list */
  int64_t parked_at;            /* when its next record, a wait, first found its signal short (0: it has not) */
  int64_t park_until;           /* when that wait times out (INT64_MAX: never) */
  ar_sig *park_sig;             /* what that wait waits for: park_sig reaching park_v */
  uint64_t park_v;
  int64_t idle_at;              /* when a shared worker last let go of it with its queue empty (0: since taken) */
  int finished;                 /* its K_STOP has run (under lock; ar_engine_join waits on cond) */
} ar_engine;

enum { R_IDLE, R_QUEUED, R_RUNNING, R_PARKED };

/* The shared workers (see "Shared workers" at the top and the functions below). */
static struct {
  pthread_mutex_t lock;
  pthread_cond_t cond; /* on CLOCK_MONOTONIC */
  ar_engine *head, *tail; /* the ready list */
  ar_engine *parked;      /* queues whose next record waits for a signal */
  _Atomic int ready;      /* queues on the ready list */
  int sleeping;           /* workers waiting on cond */
  _Atomic int looking;    /* workers in take_ready (polling or asleep) */
  _Atomic int threads;    /* workers running (changed under lock) */
  _Atomic int base;       /* the workers asked for, one per CPU the process may use; more are started while
                           * queues starve (see the watchdog) */
  _Atomic uint64_t progress; /* records run by the workers, all told */
  pthread_cond_t watch;      /* the watchdog waits on it (CLOCK_MONOTONIC) */
  int watch_idle;            /* the watchdog waits with no timeout: signal `watch` when queues may starve */
  _Atomic int64_t spin_now;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

#define STARVED_NS 2000000 /* queues ready while no worker ran a record for this long: one more worker */


static void log_failure(ar_engine *e, const ar_cmd *c, uint32_t kind, int64_t code) {
  pthread_mutex_lock(&e->log_lock);
  if (e->nfails == e->capfails) {
    size_t cap = e->capfails ? e->capfails * 2 : 16;
    failure *grown = realloc(e->fails, cap * sizeof(failure));
    if (grown) {
      e->fails = grown;
      e->capfails = cap;
    }
  }
  if (e->nfails < e->capfails) {
    failure *f = &e->fails[e->nfails++];
    f->value = c->value;
    f->index = c->index;
    f->kind = kind;
    f->code = code;
  }
  pthread_mutex_unlock(&e->log_lock);
  if (atomic_load(&e->last_failed) < c->value) atomic_store(&e->last_failed, c->value);
  atomic_fetch_add(&e->fail_count, 1);
}

static void log_range(ar_engine *e, const ar_cmd *c, int64_t start, int64_t end) {
  pthread_mutex_lock(&e->log_lock);
  if (e->nranges == e->capranges) {
    size_t cap = e->capranges ? e->capranges * 2 : 1024;
    range_rec *grown = realloc(e->ranges, cap * sizeof(range_rec));
    if (grown) {
      e->ranges = grown;
      e->capranges = cap;
    }
  }
  if (e->nranges < e->capranges) {
    range_rec *r = &e->ranges[e->nranges++];
    r->start = start;
    r->end = end;
    r->op = c->op;
    r->name = c->name;
  }
  pthread_mutex_unlock(&e->log_lock);
  atomic_fetch_add(&e->range_count, 1);
}

/* Take up to max failures (4 words each: value, index, kind, code) into out; returns how many. */
size_t ar_take_failures(ar_engine *e, uint64_t *out, size_t max) {
  pthread_mutex_lock(&e->log_lock);
  size_t n = e->nfails < max ? e->nfails : max;
  for (size_t i = 0; i < n; i++) {
    out[4 * i] = e->fails[i].value;
    out[4 * i + 1] = e->fails[i].index;
    out[4 * i + 2] = e->fails[i].kind;
    out[4 * i + 3] = (uint64_t)e->fails[i].code;
  }
  memmove(e->fails, e->fails + n, (e->nfails - n) * sizeof(failure));
  e->nfails -= n;
  pthread_mutex_unlock(&e->log_lock);
  return n;
}

/* Take up to max ranges (4 words each: start ns, end ns, op id, name id) into out; returns how many. */
size_t ar_take_ranges(ar_engine *e, uint64_t *out, size_t max) {
  pthread_mutex_lock(&e->log_lock);
  size_t n = e->nranges < max ? e->nranges : max;
  memcpy(out, e->ranges, n * sizeof(range_rec));
  memmove(e->ranges, e->ranges + n, (e->nranges - n) * sizeof(range_rec));
  e->nranges -= n;
  pthread_mutex_unlock(&e->log_lock);
  return n;
}

/* Whether the high-priority engine h has work it can run: records not yet taken, and no wait blocking it. */
static int has_runnable(ar_engine *h) {
  return atomic_load(&h->published) != atomic_load(&h->consumed) && !atomic_load(&h->waiting);
}

/* At an op boundary: let the high-priority sibling (if any) run what it can first, waiting for it a while at a
 * time. A shared worker gives e up instead (1) where the sibling waits for a worker to take it, or another queue
 * does: it goes to the back of the ready list. */
static int yield_to_high(ar_engine *e) {
  ar_engine *h = atomic_load_explicit(&e->high, memory_order_acquire);
  while (h && has_runnable(h)) {
    if (e->shared && h->shared && (atomic_load(&h->run_state) != R_RUNNING || atomic_load(&pool.ready))) return 1;
    ar_sig_wait(h->timeline, atomic_load(&h->timeline->value) + 1, YIELD_NS);
  }
  return 0;
}

/* The record at the head of e's queue, published and not yet taken; NULL if there is none. Its worker only. */
static ar_cmd *head_cmd(ar_engine *e) {
  if (atomic_load_explicit(&e->published, memory_order_acquire) == atomic_load_explicit(&e->consumed, memory_order_relaxed))
    return NULL;
  if (e->head_pos == CHUNK) {
    chunk *old = e->head;
    e->head = atomic_load_explicit(&old->next, memory_order_acquire);
    e->head_pos = 0;
    free(old);
  }
  return &e->head->cmds[e->head_pos];
}

/* Take the head record (copied out first: its slot may be freed with its chunk once it is taken). */
static ar_cmd take_cmd(ar_engine *e, const ar_cmd *c) {
  ar_cmd cmd = *c;
  e->head_pos++;
  atomic_store_explicit(&e->consumed, atomic_load_explicit(&e->consumed, memory_order_relaxed) + 1,
                        memory_order_release);
  return cmd;
}

/* Polling pays where work comes back within spin_ns of running out: poll that long next time, else half as long
 * (judged by when the work was appended, `came`, not when it was seen; `start`: when the work ran out). */
static void adapt_spin(_Atomic int64_t *spin_now, int64_t spin_ns, int64_t start, int64_t came) {
  int64_t spin = atomic_load_explicit(spin_now, memory_order_relaxed);
  atomic_store_explicit(spin_now, came - start <= spin_ns ? spin_ns : spin / 2, memory_order_relaxed);
}

static _Atomic int own_pollers;    /* workers of their own polling now */
static _Atomic int own_poll_limit; /* how many may: the CPUs the process may use less one (at least one) */

/* A worker of its own: the next record of e's queue, once there is one (polling a while, then asleep). It
 * polls only while fewer workers of their own poll than own_poll_limit: many queues with threads of their own
 * (many devices) never poll on every CPU at once. */
static ar_cmd *next_cmd(ar_engine *e) {
  ar_cmd *cmd = head_cmd(e);
  if (cmd) return cmd;
  int64_t start = now_ns(), spin = atomic_load_explicit(&e->spin_now, memory_order_relaxed), until = start + spin;
  int polling = spin && atomic_fetch_add(&own_pollers, 1) < atomic_load(&own_poll_limit);
  if (spin && !polling) atomic_fetch_sub(&own_pollers, 1);
  while (!(cmd = head_cmd(e))) {
    if (polling && now_ns() < until) { /* poll a while (a wake-up costs more), giving the CPU to any thread that wants it */
      sched_yield();
      continue;
    }
    if (polling) {
      atomic_fetch_sub(&own_pollers, 1);
      polling = 0;
    }
    pthread_mutex_lock(&e->lock);
    atomic_store(&e->sleeping, 1);
    while (atomic_load(&e->published) == atomic_load_explicit(&e->consumed, memory_order_relaxed))
      pthread_cond_wait(&e->cond, &e->lock);
    atomic_store(&e->sleeping, 0);
    pthread_mutex_unlock(&e->lock);
  }
  if (polling) atomic_fetch_sub(&own_pollers, 1);
  if (e->spin_ns) adapt_spin(&e->spin_now, e->spin_ns, start, cmd->t ? cmd->t : now_ns());
  return cmd;
}

/* Hand a python command to the engine's Python thread and wait for its answer (0: it ran). */
static int run_python(ar_engine *e, const ar_cmd *c) {
  pthread_mutex_lock(&e->py_lock);
  e->py_value = c->op;
  e->py_index = c->index;
  e->py_state = 1;
  pthread_cond_broadcast(&e->py_cond);
  while (e->py_state != 3) pthread_cond_wait(&e->py_cond, &e->py_lock);
  int rc = e->py_rc;
  e->py_state = 0;
  pthread_mutex_unlock(&e->py_lock);
  return rc;
}

typedef int (*entry_fn)(const uint64_t *args);

/* The worker starts on the op of `cmd` (its first record) unless it has: the metrics of taking it. */
static void op_taken(ar_engine *e, const ar_cmd *cmd) {
  if (cmd->value == e->current) return;
  e->current = cmd->value;
  atomic_store_explicit(&e->taken, e->current, memory_order_relaxed);
  if (e->metrics) {
    e->taken_t = now_ns();
    atomic_store_explicit(&e->taken_at, e->taken_t, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->queued_hist[bucket(e->taken_t - cmd->t)], 1, memory_order_relaxed);
  }
}

/* Run `cmd`, the record just taken off e's queue (not a K_STOP), as e's worker: a wait blocks for its signal. */
static void run_record(ar_engine *e, const ar_cmd *cmd) {
  e->boundary = (cmd->flags & F_END) != 0;
  op_taken(e, cmd);
  if (cmd->d && cmd->kind >= K_COPY && cmd->kind <= K_PY && e->skipping != cmd->value) {
    /* the op's first copy, kernel or check, its waits passed: d is its gate (skip flag, deadline ns, shared) */
    const int64_t *gate = (const int64_t *)(uintptr_t)cmd->d;
    int kind = __atomic_load_n(&gate[2], __ATOMIC_ACQUIRE)  ? 0 /* read by work outside: never skipped */
               : (gate[1] && now_ns() >= gate[1])          ? E_DEADLINE
               : __atomic_load_n(&gate[0], __ATOMIC_ACQUIRE) ? E_SKIPPED
                                                             : 0;
    if (kind) {
      log_failure(e, cmd, (uint32_t)kind, 0);
      atomic_fetch_add(&e->skipped, 1);
      e->skipping = cmd->value;
    }
  }
  if (e->skipping == cmd->value) {
    if (cmd->kind == K_SIGNAL) ar_sig_set((ar_sig *)(uintptr_t)cmd->a, cmd->b);
  } else {
    int64_t start = (cmd->flags & F_RECORD) ? now_ns() : 0;
    int ranged = 0;
    switch (cmd->kind) {
      case K_WAIT: {
        ar_sig *s = (ar_sig *)(uintptr_t)cmd->a;
        if (atomic_load(&s->value) < cmd->b) {
          atomic_store(&e->waiting, 1);
          int timed_out = ar_sig_wait(s, cmd->b, (int64_t)cmd->c);
          atomic_store(&e->waiting, 0);
          if (timed_out) {
            log_failure(e, cmd, E_TIMEOUT, (int64_t)atomic_load(&s->value));
            e->skipping = cmd->value;
          }
        }
        break;
      }
      case K_SIGNAL:
        if (ar_sig_set((ar_sig *)(uintptr_t)cmd->a, cmd->b)) {
          log_failure(e, cmd, E_ORDER, (int64_t)cmd->b);
          e->skipping = cmd->value;
        }
        break;
      case K_TIMESTAMP:
        *(int64_t *)(uintptr_t)cmd->a = now_ns();
        break;
      case K_COPY: {
        int side = guarded_copy((void *)(uintptr_t)cmd->a, (const void *)(uintptr_t)cmd->b, cmd->c);
        ranged = !side;
        if (side) { /* a file-backed page gone (see "guarded copies"): code 1 the source, 2 the destination */
          log_failure(e, cmd, E_FAULT, side);
          e->skipping = cmd->value;
        }
        break;
      }
      case K_EXEC: {
        int rc = ((entry_fn)(uintptr_t)cmd->a)((const uint64_t *)(uintptr_t)cmd->b);
        ranged = !rc; /* a command that failed records no range */
        if (rc) {
          log_failure(e, cmd, E_KERNEL, rc);
          e->skipping = cmd->value;
        }
        break;
      }
      case K_NOP:
        ranged = 1;
        break;
      case K_CHECK: {
        /* a = pointer to b pairs (engine, value) of inputs (a value with TAG set: the address of the cell of
         * an op that was pending); if any of their engines has a failure at or after the input's value,
         * Python decides (command index c) */
        const uint64_t *pairs = (const uint64_t *)(uintptr_t)cmd->a;
        int ask = 0;
        for (uint64_t i = 0; i < cmd->b; i++) {
          ar_engine *other = (ar_engine *)(uintptr_t)pairs[2 * i];
          uint64_t v = pairs[2 * i + 1];
          if (v & TAG) v = __atomic_load_n((uint64_t *)(uintptr_t)(v & ~TAG), __ATOMIC_ACQUIRE);
          if (!other || v == ABANDONED || atomic_load(&other->last_failed) >= v) ask = 1;
        }
        if (ask && run_python(e, cmd)) {
          log_failure(e, cmd, E_PYTHON, 0);
          e->skipping = cmd->value;
        }
        break;
      }
      case K_PY:
        ranged = 1;
        if (run_python(e, cmd)) {
          ranged = 0;
          log_failure(e, cmd, E_PYTHON, 0);
          e->skipping = cmd->value;
        }
        break;
    }
    if (ranged && (cmd->flags & F_RECORD)) log_range(e, cmd, start, now_ns());
  }
  if (cmd->flags & F_END) {
    if (e->skipping == cmd->value) e->skipping = 0;
    if (e->metrics) {
      int64_t ran = now_ns() - e->taken_t;
      atomic_fetch_add_explicit(&e->run_hist[bucket(ran)], 1, memory_order_relaxed);
      atomic_fetch_add_explicit(&e->busy_ns, (uint64_t)ran, memory_order_relaxed);
      atomic_store_explicit(&e->taken_at, 0, memory_order_relaxed);
    }
    ar_sig_set(e->timeline, cmd->value);
  }
}

static void *worker(void *arg) {
  ar_engine *e = arg;
  atomic_store(&e->tid, (int64_t)syscall(SYS_gettid));
  for (;;) {
    if (e->boundary) yield_to_high(e);
    ar_cmd cmd = take_cmd(e, next_cmd(e));
    if (cmd.kind == K_STOP) break;
    run_record(e, &cmd);
  }
  ar_py_stop(e);
  return NULL;
}

/* ---- the shared workers (see "Shared workers" at the top) ------------------------------------------------ */

/* Put e at the back of the ready list (under pool.lock). */
static void push_ready(ar_engine *e) {
  e->next_ready = NULL;
  if (pool.tail) pool.tail->next_ready = e;
  else pool.head = e;
  pool.tail = e;
  atomic_store(&e->run_state, R_QUEUED);
  int ready = atomic_fetch_add(&pool.ready, 1) + 1;
  /* a worker looking for work and not asleep takes a ready queue before it may sleep (it looks at the list under
   * the lock held here): wake a sleeper only for the queues those cannot take (a wake-up costs the waker) */
  if (pool.sleeping && ready > atomic_load(&pool.looking) - pool.sleeping) pthread_cond_signal(&pool.cond);
  else if (!atomic_load(&pool.looking) && pool.watch_idle) pthread_cond_signal(&pool.watch); /* all busy */
}

/* Records were appended to shared e: put it on the ready list unless a worker has it, it is there, or it is
 * parked (its next record is a wait: what meets the wait puts it back). Against a worker letting go of an empty
 * queue: each writes its side (published, run_state) before reading the other's. */
static void queue_ready(ar_engine *e) {
  if (atomic_load(&e->run_state) != R_IDLE) return;
  pthread_mutex_lock(&pool.lock);
  if (atomic_load(&e->run_state) == R_IDLE) push_ready(e);
  pthread_mutex_unlock(&pool.lock);
}

/* The queues parked on a wait for s that v meets go back on the ready list (s NULL: every parked queue, to look
 * at its wait again once a timeout may have passed). */
static void unpark(ar_sig *s, uint64_t v) {
  pthread_mutex_lock(&pool.lock);
  for (ar_engine **at = &pool.parked; *at;) {
    ar_engine *e = *at;
    if (s && (e->park_sig != s || e->park_v > v)) {
      at = &e->next_ready;
      continue;
    }
    *at = e->next_ready;
    atomic_fetch_sub(&parked_queues, 1);
    push_ready(e);
  }
  pthread_mutex_unlock(&pool.lock);
}

/* Whether a worker that looks for work may poll: it leaves a CPU free for the threads that submit work (the
 * other workers running a queue are fewer than the CPUs less one). Where every other CPU is busy, polling would
 * take the CPU the submitter needs; it sleeps at once. */
static int cpu_spare(void) {
  return atomic_load(&pool.threads) - atomic_load(&pool.looking) < atomic_load(&pool.base) - 1;
}

/* The next ready queue (now the caller's: R_RUNNING), once there is one: polling a while, then asleep until
 * one is, or until the earliest timeout of a parked queue's wait (then every parked queue looks again). */
static ar_engine *take_ready(void) {
  int64_t start = 0;
  atomic_fetch_add(&pool.looking, 1);
  for (;;) {
    if (atomic_load(&pool.ready)) {
      pthread_mutex_lock(&pool.lock);
      ar_engine *e = pool.head;
      if (e) {
        pool.head = e->next_ready;
        if (!pool.head) pool.tail = NULL;
        atomic_fetch_sub(&pool.ready, 1);
        atomic_fetch_sub(&pool.looking, 1);
        atomic_store(&e->run_state, R_RUNNING);
        if (pool.head && !atomic_load(&pool.looking) && pool.watch_idle) pthread_cond_signal(&pool.watch); /* all busy */
        pthread_mutex_unlock(&pool.lock);
        if (e->idle_at && e->spin_ns) { /* it had run dry: poll as its own worker would (and the workers so) */
          ar_cmd *next = head_cmd(e);
          adapt_spin(&e->spin_now, e->spin_ns, e->idle_at, next && next->t ? next->t : now_ns());
          atomic_store_explicit(&pool.spin_now, atomic_load(&e->spin_now), memory_order_relaxed);
        }
        e->idle_at = 0;
        return e;
      }
      pthread_mutex_unlock(&pool.lock);
    }
    int64_t now = now_ns();
    if (!start) start = now;
    if (cpu_spare() && now < start + atomic_load_explicit(&pool.spin_now, memory_order_relaxed)) {
      sched_yield();
      continue;
    }
    pthread_mutex_lock(&pool.lock);
    if (!pool.head && pool.threads > pool.base && (pool.sleeping || !pool.parked)) {
      /* a worker started for starving queues: none starve now (and another one watches parked waits' timeouts) */
      pool.threads--;
      atomic_fetch_sub(&pool.looking, 1);
      pthread_mutex_unlock(&pool.lock);
      return NULL;
    }
    if (!pool.head) {
      int64_t until = INT64_MAX;
      for (ar_engine *p = pool.parked; p; p = p->next_ready)
        if (p->park_until < until) until = p->park_until;
      pool.sleeping++;
      int timed_out = 0;
      if (until == INT64_MAX) {
        pthread_cond_wait(&pool.cond, &pool.lock);
      } else {
        struct timespec at = {.tv_sec = until / 1000000000, .tv_nsec = until % 1000000000};
        timed_out = pthread_cond_timedwait(&pool.cond, &pool.lock, &at) == ETIMEDOUT;
      }
      pool.sleeping--;
      if (timed_out) {
        pthread_mutex_unlock(&pool.lock);
        unpark(NULL, 0);
        continue;
      }
    }
    pthread_mutex_unlock(&pool.lock);
  }
}

enum { S_EMPTY, S_PARKED, S_YIELD, S_STOPPED };

/* Run e's records (e is the caller's) until its queue is empty (S_EMPTY), its next record waits for a signal
 * not reached (S_PARKED), at an op boundary another queue is ready and no other worker is free to take it, or
 * its high-priority sibling has work no worker has taken (S_YIELD), or it has stopped (S_STOPPED: e is no longer
 * touched, it may be freed). */
static int serve(ar_engine *e) {
  int ran = 0;
  for (;;) {
    ar_cmd *c = head_cmd(e);
    if (!c) return S_EMPTY;
    if (e->boundary) {
      if (yield_to_high(e)) return S_YIELD;
      if (ran && atomic_load(&pool.ready) && !atomic_load(&pool.looking)) return S_YIELD; /* none free to take it */
    }
    if (c->kind == K_WAIT && e->skipping != c->value) {
      ar_sig *s = (ar_sig *)(uintptr_t)c->a;
      if (atomic_load(&s->value) < c->b) {
        int64_t now = now_ns(), limit = (int64_t)c->c;
        if (!e->parked_at) {
          op_taken(e, c); /* its wait counts as run time, as on a worker of its own */
          e->parked_at = now;
          e->park_until = limit < 0 || limit > INT64_MAX - now ? INT64_MAX : now + limit;
        }
        if (now < e->park_until) {
          e->park_sig = s;
          e->park_v = c->b;
          return S_PARKED;
        }
      }
    }
    ar_cmd cmd = take_cmd(e, c);
    if (cmd.kind == K_STOP) {
      ar_py_stop(e);
      pthread_mutex_lock(&e->lock);
      e->finished = 1;
      pthread_cond_broadcast(&e->cond);
      pthread_mutex_unlock(&e->lock);
      return S_STOPPED;
    }
    if (cmd.kind == K_WAIT) { /* its signal reached: no wait; else its timeout has passed: it fails now */
      cmd.c = 0;
      e->parked_at = 0;
      atomic_store(&e->waiting, 0);
    }
    run_record(e, &cmd);
    atomic_fetch_add_explicit(&pool.progress, 1, memory_order_relaxed);
    ran = 1;
  }
}

/* Let go of e after serve() said `how` (not S_STOPPED). */
static void let_go(ar_engine *e, int how) {
  pthread_mutex_lock(&pool.lock);
  if (how == S_PARKED) {
    atomic_store(&e->waiting, 1);
    atomic_fetch_add(&parked_queues, 1);
    if (atomic_load(&e->park_sig->value) >= e->park_v) { /* met before it was parked (that set found nothing) */
      atomic_fetch_sub(&parked_queues, 1);
      push_ready(e);
    } else {
      atomic_store(&e->run_state, R_PARKED);
      e->next_ready = pool.parked;
      pool.parked = e;
      if (e->park_until != INT64_MAX && pool.sleeping) pthread_cond_broadcast(&pool.cond); /* its timeout: look */
    }
  } else if (how == S_YIELD) {
    push_ready(e);
  } else {
    e->idle_at = now_ns();
    atomic_store(&e->run_state, R_IDLE);
    atomic_thread_fence(memory_order_seq_cst); /* against append: its published store, then its run_state load */
    if (head_cmd(e)) push_ready(e);
  }
  pthread_mutex_unlock(&pool.lock);
}

static void *shared_worker(void *arg) {
  (void)arg;
  ar_engine *e;
  while ((e = take_ready())) {
    int how = serve(e);
    if (how != S_STOPPED) let_go(e, how);
  }
  return NULL;
}

/* The watchdog: a command may keep its worker for long (a kernel that waits for what another queue is to
 * write would otherwise wait for ever), so while queues are ready and every worker is busy with no record run
 * for STARVED_NS, it starts one more worker (which ends once it finds nothing to do). Idle, it waits with no
 * timeout until push_ready finds every worker busy. */
static void *watchdog(void *arg) {
  (void)arg;
  pthread_mutex_lock(&pool.lock);
  for (;;) {
    if (!pool.head || atomic_load(&pool.looking)) {
      pool.watch_idle = 1;
      pthread_cond_wait(&pool.watch, &pool.lock);
      pool.watch_idle = 0;
      continue;
    }
    uint64_t seen = atomic_load(&pool.progress);
    int64_t until = now_ns() + STARVED_NS;
    struct timespec at = {.tv_sec = until / 1000000000, .tv_nsec = until % 1000000000};
    pthread_cond_timedwait(&pool.watch, &pool.lock, &at);
    if (pool.head && !atomic_load(&pool.looking) && atomic_load(&pool.progress) == seen && now_ns() >= until) {
      pthread_t t;
      if (pthread_create(&t, NULL, shared_worker, NULL) == 0) {
        pthread_detach(t);
        pool.threads++;
      }
    }
  }
  return NULL;
}

static int shared_started; /* start_shared has run (in this process) */
static void after_fork(void);
static void register_after_fork(void) { pthread_atfork(NULL, NULL, after_fork); }

/* In a child forked from a process whose engines run: it has none of their workers (only the forking thread
 * lives on), so the next shared engine starts its own, and no worker of its own polls yet. A lock one of them held
 * when the process forked would stay held in the child for good: the locks the child's own loops, signals and
 * pending ops take are made anew. */
static void after_fork(void) {
  pthread_mutex_init(&notifiers_lock, NULL);
  pthread_mutex_init(&sigs_lock, NULL);
  for (ar_sig *s = all_sigs; s; s = s->next) sig_sync_init(s);
  pthread_mutex_init(&pend_lock, NULL);
  pthread_mutex_init(&pool.lock, NULL);
  pool.head = pool.tail = pool.parked = NULL;
  atomic_store(&pool.ready, 0);
  atomic_store(&pool.looking, 0);
  atomic_store(&parked_queues, 0);
  atomic_store(&own_pollers, 0);
  pool.sleeping = pool.watch_idle = 0;
  atomic_store(&pool.threads, 0);
  atomic_store(&pool.base, 0);
  shared_started = 0;
}

/* Start the shared workers (`threads` of them) unless they run already: 0, or -1 if none could start. */
static int start_shared(int threads, int64_t spin_ns) {
  pthread_mutex_lock(&pool.lock);
  if (!shared_started) {
    shared_started = 1;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&pool.cond, &attr);
    pthread_cond_init(&pool.watch, &attr);
    pthread_condattr_destroy(&attr);
    atomic_store(&pool.spin_now, spin_ns);
    pthread_t t;
    if (pthread_create(&t, NULL, watchdog, NULL) == 0) {
      pthread_detach(t);
      for (int i = 0; i < threads; i++) {
        if (pthread_create(&t, NULL, shared_worker, NULL) != 0) break;
        pthread_detach(t);
        pool.threads++;
      }
      pool.base = pool.threads;
    }
  }
  int ok = pool.threads > 0;
  pthread_mutex_unlock(&pool.lock);
  return ok ? 0 : -1;
}

/* A new engine whose op values go to `timeline`: run by a worker thread of its own (`workers` 0, polling up to
 * spin_ns for work before it sleeps) or by the shared workers (`workers` > 0: as many are started with the first
 * such engine, polling as long). NULL if it could not start. */
ar_engine *ar_engine_new(ar_sig *timeline, int64_t spin_ns, int workers) {
  static pthread_once_t at_fork = PTHREAD_ONCE_INIT;
  pthread_once(&at_fork, register_after_fork); /* a child forked later resets what its parent's threads counted */
  if (workers > 0 && start_shared(workers, spin_ns)) return NULL;
  if (!atomic_load(&own_poll_limit)) { /* from the thread that opens the first engine (not a pinned worker) */
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 2;
    atomic_store(&own_poll_limit, cpus > 2 ? cpus - 1 : 1);
  }
  ar_engine *e = NULL;
  if (posix_memalign((void **)&e, 64, sizeof(ar_engine)) != 0) return NULL;
  memset(e, 0, sizeof(*e));
  e->timeline = timeline;
  e->spin_ns = spin_ns;
  atomic_store(&e->spin_now, spin_ns);
  e->boundary = 1;
  e->shared = workers > 0;
  atomic_store(&e->run_state, R_IDLE);
  e->head = e->tail = calloc(1, sizeof(chunk));
  if (!e->head) {
    free(e);
    return NULL;
  }
  pthread_mutex_init(&e->lock, NULL);
  pthread_mutex_init(&e->submit_lock, NULL);
  pthread_cond_init(&e->cond, NULL);
  pthread_mutex_init(&e->log_lock, NULL);
  pthread_mutex_init(&e->py_lock, NULL);
  pthread_cond_init(&e->py_cond, NULL);
  if (e->shared) return e; /* its thread id stays 0: no thread of its own */
  if (pthread_create(&e->thread, NULL, worker, e) != 0) {
    free(e->head);
    free(e);
    return NULL;
  }
  e->started = 1;
  while (!atomic_load(&e->tid)) sched_yield(); /* the thread id is there once the engine is */
  return e;
}

/* Append n command records under the submit lock, as the op of value `value` (0: a K_STOP, no op). Returns
 * 0, or -1 if memory for a new chunk could not be had (nothing was appended). */
static int append(ar_engine *e, const ar_cmd *cmds, uint32_t n, uint64_t value) {
  unsigned free_here = CHUNK - e->tail_pos;
  if (n > free_here) { /* chunks for all of them first, so that a failure appends nothing */
    chunk *first = NULL, *last = NULL;
    for (uint32_t have = free_here; have < n; have += CHUNK) {
      chunk *fresh = calloc(1, sizeof(chunk));
      if (!fresh) {
        while (first) {
          chunk *next = atomic_load(&first->next);
          free(first);
          first = next;
        }
        return -1;
      }
      if (last) atomic_store(&last->next, fresh);
      else first = fresh;
      last = fresh;
    }
    atomic_store_explicit(&e->tail->next, first, memory_order_release);
  }
  int64_t t = e->metrics ? now_ns() : 0;
  for (uint32_t i = 0; i < n; i++) {
    if (e->tail_pos == CHUNK) {
      e->tail = atomic_load(&e->tail->next);
      e->tail_pos = 0;
    }
    ar_cmd *slot = &e->tail->cmds[e->tail_pos++];
    *slot = cmds[i];
    slot->t = t;
    if (value) slot->value = value;
  }
  atomic_fetch_add(&e->published, n);
  if (e->shared) {
    queue_ready(e);
  } else if (atomic_load(&e->sleeping)) { /* once it holds the lock the worker waits on cond: signal it after letting go,
                                    * so that it does not wake only to block on the lock we hold */
    pthread_mutex_lock(&e->lock);
    pthread_mutex_unlock(&e->lock);
    pthread_cond_signal(&e->cond);
  }
  return 0;
}

/* Append an op's n command records (their value fields are set here) and wake the worker if it sleeps.
 * Returns the op's value on the engine's timeline; 0 if the engine has stopped or memory for a new chunk
 * could not be had (nothing was appended). A K_STOP record stops the engine (and returns 0). */
uint64_t ar_submit(ar_engine *e, const ar_cmd *cmds, uint32_t n) {
  uint64_t value = 0;
  pthread_mutex_lock(&e->submit_lock);
  if (!e->stopped) {
    if (n == 1 && cmds[0].kind == K_STOP) {
      if (append(e, cmds, 1, 0) == 0) e->stopped = 1;
    } else if (append(e, cmds, n, atomic_load(&e->last) + 1) == 0) {
      value = atomic_load(&e->last) + 1;
      atomic_store(&e->last, value);
    }
  }
  pthread_mutex_unlock(&e->submit_lock);
  return value;
}

/* ---- pending ops: handed to their queue by the core the moment their last dependency is met ------------ */

/* A pending op waits for conditions: a signal reaching a value, or another pending op being handed to its
 * queue ("dispatched") or done. `count` is its unmet conditions plus one until ar_pend_go; whichever thread
 * meets the last one appends the op's records to its engine's ring (no Python, no event loop) and writes the
 * op's value into `cell`, memory Python owns and reads (ABANDONED: its engine had stopped). A signal fires its
 * watchers before it publishes the value that met them, so an op whose dependencies Python sees done has
 * been handed on. Records of pending ops live in a pool that is never freed (a stale pointer stays
 * readable; `cell` says whose the record is). */

typedef struct waiter {
  pend *p;
  int on_done;
  struct waiter *next;
} waiter;

struct pend {
  ar_engine *e;
  ar_cmd *cmds;
  uint32_t n;
  int state; /* 0: free, 1: pending (under pend_lock) */
  uint64_t *cell;
  uint64_t value; /* while it is being handed on */
  _Atomic int64_t count;
  waiter *waiters; /* under pend_lock */
  uint64_t notify;  /* notifier slots to write once it is handed on (under pend_lock) */
  pend *next_free;  /* on the free list, or on a list of ops to hand on */
  pend *next_batch; /* on the list of ops handed on to one queue at once */
};

static pend *free_pends;

static int on_sig(pend *p, ar_sig *s, uint64_t v);

/* One of p's conditions is met: 1 if it was the last (the caller dispatches p). */
static int met(pend *p) { return atomic_fetch_sub(&p->count, 1) == 1; }

/* Hand p to its queue, then pass on what its dispatch meets, iteratively. Under the queue's submit lock,
 * before anything is appended (so before any of it can run and publish a value): each op's value goes into its
 * cell, what waits for it to be done becomes a watch on the queue's timeline (a watch fires before the value
 * that meets it is published), and ops of the same queue that waited only for its dispatch join the batch,
 * with the next values. Then the batch is appended in order. */
static void dispatch(pend *p) {
  pend *todo = p;
  p->next_free = NULL;
  while (todo) {
    pend *first = todo;
    todo = first->next_free;
    ar_engine *e = first->e;
    uint64_t notify = 0;
    pthread_mutex_lock(&e->submit_lock);
    uint64_t next = atomic_load(&e->last);
    pend *tail = first;
    first->next_batch = NULL;
    for (pend *cur = first; cur; cur = cur->next_batch) {
      cur->value = e->stopped ? ABANDONED : ++next;
      pthread_mutex_lock(&pend_lock);
      __atomic_store_n(cur->cell, cur->value, __ATOMIC_RELEASE);
      waiter *ws = cur->waiters;
      cur->waiters = NULL;
      cur->state = 0; /* a later ar_pend_on_pend reads the cell */
      uint64_t asked = cur->notify; /* the loops waiting for it to be handed on: noted now, told once appended */
      cur->notify = 0;
      pthread_mutex_unlock(&pend_lock);
      notify |= asked;
      for (int n = 0; asked; n++, asked >>= 1)
        if (asked & 1) note_handed(n, cur->cell);
      while (ws) {
        waiter *w = ws;
        ws = w->next;
        int abandoned = cur->value == ABANDONED;
        if ((w->on_done && !abandoned) ? on_sig(w->p, e->timeline, cur->value) : met(w->p)) {
          if (w->p->e == e && !abandoned) {
            w->p->next_batch = NULL;
            tail->next_batch = w->p;
            tail = w->p;
          } else {
            w->p->next_free = todo;
            todo = w->p;
          }
        }
        free(w);
      }
    }
    for (pend *cur = first; cur; cur = cur->next_batch) {
      if (cur->value == ABANDONED) continue;
      if (append(e, cur->cmds, cur->n, cur->value) == 0) {
        atomic_store(&e->last, cur->value);
      } else { /* no memory for a chunk: it and the rest of the batch are abandoned (their watches stay met) */
        for (pend *rest = cur; rest; rest = rest->next_batch) __atomic_store_n(rest->cell, ABANDONED, __ATOMIC_RELEASE);
        break;
      }
    }
    pthread_mutex_unlock(&e->submit_lock);
    for (int n = 0; notify; n++, notify >>= 1)
      if (notify & 1) ar_notify(n);
    pthread_mutex_lock(&pend_lock);
    for (pend *cur = first, *after; cur; cur = after) {
      after = cur->next_batch;
      free(cur->cmds);
      cur->cmds = NULL;
      cur->next_free = free_pends;
      free_pends = cur;
    }
    pthread_mutex_unlock(&pend_lock);
  }
}

/* Register "s reaches v" as a condition p already counts; 1 if that met its last one. */
static int on_sig(pend *p, ar_sig *s, uint64_t v) {
  watch *w = malloc(sizeof(watch));
  pthread_mutex_lock(&s->lock);
  if (w && atomic_load(&s->value) < v && atomic_load(&s->setting) < v) {
    w->v = v;
    w->p = p;
    w->next = s->watches;
    s->watches = w;
    if (v < atomic_load(&s->watch_min)) atomic_store(&s->watch_min, v);
    /* a set() that began meanwhile may have missed the watch: it is met if so (seq_cst against set()) */
    if (atomic_load(&s->setting) < v) {
      pthread_mutex_unlock(&s->lock);
      return 0;
    }
    s->watches = w->next;
  }
  pthread_mutex_unlock(&s->lock);
  free(w); /* no memory for the watch: wait for it here instead of hanging the op */
  if (!w && atomic_load(&s->value) < v) ar_sig_wait(s, v, -1);
  return met(p);
}

static void watches_take(ar_sig *s, uint64_t v, pend **todo) {
  pthread_mutex_lock(&s->lock);
  uint64_t least = NEVER;
  for (watch **at = &s->watches; *at;) {
    watch *w = *at;
    if (w->v <= v) {
      *at = w->next;
      if (met(w->p)) {
        w->p->next_free = *todo;
        *todo = w->p;
      }
      free(w);
    } else {
      if (w->v < least) least = w->v;
      at = &w->next;
    }
  }
  atomic_store(&s->watch_min, least);
  pthread_mutex_unlock(&s->lock);
}

static void dispatch_all(pend *todo) {
  while (todo) {
    pend *p = todo;
    todo = p->next_free;
    dispatch(p);
  }
}

static void watches_fire(ar_sig *s, uint64_t v) {
  pend *todo = NULL;
  watches_take(s, v, &todo);
  dispatch_all(todo);
}

/* A signal that goes away meets every condition on it (nothing is left hanging on memory being freed). */
static void watches_drop(ar_sig *s) { watches_fire(s, NEVER); }

/* A new pending op of engine e: n records (copied), `cell` where its value is written once it is handed on.
 * Add its conditions, then call ar_pend_go. NULL without memory. */
pend *ar_pend_new(ar_engine *e, const ar_cmd *cmds, uint32_t n, uint64_t *cell) {
  pthread_mutex_lock(&pend_lock);
  pend *p = free_pends;
  if (p) free_pends = p->next_free;
  pthread_mutex_unlock(&pend_lock);
  if (!p && !(p = calloc(1, sizeof(pend)))) return NULL;
  p->cmds = malloc((size_t)n * sizeof(ar_cmd));
  if (!p->cmds) {
    pthread_mutex_lock(&pend_lock);
    p->next_free = free_pends;
    free_pends = p;
    pthread_mutex_unlock(&pend_lock);
    return NULL;
  }
  memcpy(p->cmds, cmds, (size_t)n * sizeof(ar_cmd));
  p->e = e;
  p->n = n;
  p->cell = cell;
  p->waiters = NULL;
  p->notify = 0;
  atomic_store(&p->count, 1);
  pthread_mutex_lock(&pend_lock);
  p->state = 1;
  pthread_mutex_unlock(&pend_lock);
  return p;
}

/* Condition: signal s reaches v. */
void ar_pend_on_sig(pend *p, ar_sig *s, uint64_t v) {
  atomic_fetch_add(&p->count, 1);
  if (on_sig(p, s, v)) dispatch(p); /* not the last: ar_pend_go holds one */
}

/* Condition: the pending op `dep` (whose cell is `dep_cell`, of engine `dep_engine`) is dispatched, or with
 * on_done, done. If it has been handed on already, its cell says where. */
void ar_pend_on_pend(pend *p, pend *dep, uint64_t *dep_cell, ar_engine *dep_engine, int on_done) {
  atomic_fetch_add(&p->count, 1);
  waiter *w = malloc(sizeof(waiter));
  pthread_mutex_lock(&pend_lock);
  if (w && dep->state == 1 && dep->cell == dep_cell) {
    w->p = p;
    w->on_done = on_done;
    w->next = dep->waiters;
    dep->waiters = w;
    pthread_mutex_unlock(&pend_lock);
    return;
  }
  pthread_mutex_unlock(&pend_lock);
  free(w);
  uint64_t value = __atomic_load_n(dep_cell, __ATOMIC_ACQUIRE);
  if (!value) { /* no memory for the waiter: wait for the dispatch here */
    while (!(value = __atomic_load_n(dep_cell, __ATOMIC_ACQUIRE))) sched_yield();
  }
  int last = (on_done && value != ABANDONED) ? on_sig(p, dep_engine->timeline, value) : met(p);
  if (last) dispatch(p);
}

/* Write notifier n once p (whose cell is `cell`) is handed on: 0; 1 if it has been already (nothing is kept). */
int ar_pend_notify(pend *p, uint64_t *cell, int n) {
  if (n < 0 || n >= MAXN) return 1;
  int kept = 0;
  pthread_mutex_lock(&pend_lock);
  if (p->state == 1 && p->cell == cell) {
    p->notify |= 1ull << n;
    kept = 1;
  }
  pthread_mutex_unlock(&pend_lock);
  return !kept;
}

/* Every condition of p has been added: it is handed on now if they are all met, else by whoever meets the last. */
void ar_pend_go(pend *p) {
  if (met(p)) dispatch(p);
}

/* The engine's Python thread: block until a python command is posted; returns 1 with its op's id and
 * command index, or 0 once the engine has stopped. */
int ar_py_next(ar_engine *e, uint64_t *value, uint32_t *index) {
  pthread_mutex_lock(&e->py_lock);
  while (e->py_state != 1 && !e->py_stop) pthread_cond_wait(&e->py_cond, &e->py_lock);
  int got = e->py_state == 1;
  if (got) {
    *value = e->py_value;
    *index = e->py_index;
    e->py_state = 2;
  }
  pthread_mutex_unlock(&e->py_lock);
  return got;
}

void ar_py_done(ar_engine *e, int rc) {
  pthread_mutex_lock(&e->py_lock);
  e->py_rc = rc;
  e->py_state = 3;
  pthread_cond_broadcast(&e->py_cond);
  pthread_mutex_unlock(&e->py_lock);
}

/* Wake the Python thread with nothing to do (it returns 0 from ar_py_next once stopped). */
void ar_py_stop(ar_engine *e) {
  pthread_mutex_lock(&e->py_lock);
  e->py_stop = 1;
  pthread_cond_broadcast(&e->py_cond);
  pthread_mutex_unlock(&e->py_lock);
}

/* Wait for the worker to be done with e (after a K_STOP was pushed): its thread has ended, or the shared
 * worker has run the K_STOP. */
void ar_engine_join(ar_engine *e) {
  if (e->joined) return;
  if (e->shared) {
    pthread_mutex_lock(&e->lock);
    while (!e->finished) pthread_cond_wait(&e->cond, &e->lock);
    pthread_mutex_unlock(&e->lock);
    e->joined = 1;
  } else if (e->started) {
    pthread_join(e->thread, NULL);
    e->joined = 1;
  }
}

/* Free a joined engine. */
void ar_engine_free(ar_engine *e) {
  if (!e || !e->joined) return;
  for (chunk *c = e->head; c;) {
    chunk *next = atomic_load(&c->next);
    free(c);
    c = next;
  }
  free(e->fails);
  free(e->ranges);
  pthread_mutex_destroy(&e->lock);
  pthread_mutex_destroy(&e->submit_lock);
  pthread_cond_destroy(&e->cond);
  pthread_mutex_destroy(&e->log_lock);
  pthread_mutex_destroy(&e->py_lock);
  pthread_cond_destroy(&e->py_cond);
  free(e);
}

/* Let the high-priority engine h go first at e's op boundaries (see "Priorities" above); h must outlive e. */
void ar_engine_yield_to(ar_engine *e, ar_engine *h) { atomic_store_explicit(&e->high, h, memory_order_release); }

/* Keep (1) or skip (0) the clock-based metrics: call before the first submission. */
void ar_engine_metrics(ar_engine *e, int on) { e->metrics = on; }

int64_t ar_now_ns(void) { return now_ns(); }

/* Offsets Python reads engine fields at (so the layout is not repeated in Python). */
size_t ar_engine_field(int which) {
  switch (which) {
    case 0: return offsetof(ar_engine, last_failed);
    case 1: return offsetof(ar_engine, fail_count);
    case 2: return offsetof(ar_engine, range_count);
    case 3: return offsetof(ar_engine, last);
    case 4: return offsetof(ar_engine, tid);
    case 5: return offsetof(ar_engine, skipped);
    case 6: return offsetof(ar_engine, taken);
    case 7: return offsetof(ar_engine, busy_ns);
    case 8: return offsetof(ar_engine, queued_hist);
    case 9: return offsetof(ar_engine, run_hist);
    case 10: return offsetof(ar_engine, taken_at);
    case 11: return offsetof(ar_engine, spin_now);
  }
  return 0;
}
