/* The submission path of the native engine, as a CPython extension module (`submit.py` builds and loads it).
 *
 * launch(...) and copy(...) do what BaseDevice.launch, copyin and copyout do, submit(...) what
 * BaseDevice._submit does for the other op methods, and enqueue(...) what NativeEngine._enqueue does for an op
 * handed on later (from dispatch_when_ready), for the common op: one kernel or copy the worker runs without
 * Python, with no hold and normal priority, directly or through a Scheduler's window (recording a profile's
 * ranges and flows as Python does where one is recorded). They
 * check the arguments, make the Op, record its accesses in the buffers' hazard logs, and append its records (a
 * wait per other queue it depends on, a dependency check where an input is unfinished, the work, with its
 * request's gate) to the engine's ring through the core's ar_submit. A scheduler's op that waits for another
 * queue is handed to the core with its conditions (dispatch_when_ready's _pend_held and NativeEngine.pend); an
 * op that must wait otherwise (a window without room, a dependency the core cannot wait for) goes to
 * dispatch_when_ready, as in Python. retire(...) does what NativeEngine.retire does where no failure or
 * timestamp is left to set.
 *
 * Each returns None before any side effect where it cannot take the call as it stands (an argument to refuse,
 * a view not yet bound, a program without a launch plan, a command the worker runs in Python): the caller takes
 * the Python path, which stays the reference, with the same rules, and the fallback where this module cannot be
 * built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>

typedef struct {
  uint32_t kind, flags;
  uint64_t a, b, c, d;
  uint64_t value;
  uint64_t op;
  uint32_t name;
  uint32_t index;
  int64_t t;
} ar_cmd; /* as core.c's */

typedef uint64_t (*submit_fn)(void *, const ar_cmd *, uint32_t);
typedef void *(*pend_new_fn)(void *, const ar_cmd *, uint32_t, uint64_t *);
typedef void (*pend_on_sig_fn)(void *, void *, uint64_t);
typedef void (*pend_on_pend_fn)(void *, void *, uint64_t *, void *, int);
typedef void (*pend_go_fn)(void *);

enum { K_WAIT = 0, K_COPY = 3, K_EXEC = 4, K_NOP = 5, K_CHECK = 6 };
enum { C_WAIT = 0, C_EXEC = 3, C_COPY = 4 }; /* command kinds of the Python side (ops.py) */
#define F_END 1u
#define F_RECORD 2u
#define CHECK_BIT (1u << 31)
#define TAG (1ull << 63) /* in a dependency check's pair: the value is read from the cell at this address */
#define MAX_WAITS 8
#define MAX_RECORDS (MAX_WAITS + 2)
#define RETIRE_EVERY 64

static submit_fn g_submit;
static pend_new_fn g_pend_new;
static pend_on_sig_fn g_pend_on_sig;
static pend_on_pend_fn g_pend_on_pend;
static pend_go_fn g_pend_go;
static Py_ssize_t g_cells;
static uint64_t g_held, g_abandoned;
static PyTypeObject *g_op_type, *g_native_type, *g_entry_type;
static PyObject *g_nothing, *g_native_copies, *g_op_ids, *g_wait_kind;
static PyTypeObject *g_buffer_type;
static PyObject *g_recorder, *g_dispatch, *g_zeroed, *g_typed, *g_new_cells, *g_name_id, *g_record_deps;
static PyObject *g_later_acquire, *g_later_release, *g_later_locked; /* the methods of the lock ops.py takes to
                                                                        * hand a held op on */
static PyObject *g_handed_over, *g_held_value; /* ops.handed_over; HELD as an int */
static PyObject *g_logs_lock; /* this module's Lock that every op records its accesses under (hazards.logs_held) */

/* offsets of the Op's slots */
enum { S_AT, S_CELL, S_CMDS, S_DEPS, S_ENGINE, S_ERROR, S_GATE, S_ID, S_INPUTS, S_KEEP, S_LATER, S_NAME,
       S_OBSERVED, S_PEND, S_RESULT, S_VALUE, N_SLOTS };
static const char *slot_names[N_SLOTS] = {"at",   "cell",   "cmds", "deps",     "engine", "error",  "gate", "id",
                                          "inputs", "keep", "later", "name", "observed", "_pend", "result", "_value"};
static Py_ssize_t g_off[N_SLOTS];

#define SLOT(op, s) (*(PyObject **)((char *)(op) + g_off[s]))

/* The offsets of the slots `names` of `type` into `offs`: 0, or -1 with a TypeError naming one that is not a slot. */
static int slot_offsets(PyObject *type, const char *const *names, Py_ssize_t *offs, int n) {
  for (int s = 0; s < n; s++) {
    PyObject *d = PyObject_GetAttrString(type, names[s]);
    if (!d) return -1;
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
    if (ok) offs[s] = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    if (!ok) {
      PyErr_Format(PyExc_TypeError, "init: %s.%s is not a slot", ((PyTypeObject *)type)->tp_name, names[s]);
      return -1;
    }
  }
  return 0;
}

/* Where one call site reads an attribute: of objects of `type` (held) at version `version`, in the slot at
 * `off`, or by getattr where `off` is -1. */
typedef struct {
  PyTypeObject *type;
  unsigned int version;
  Py_ssize_t off;
} attr_site;

/* Where `name` lies in objects of o's type, looked up for `site` (a new type, or a type changed since). */
static void find_slot(PyObject *o, PyObject *name, attr_site *site) {
  PyTypeObject *t = Py_TYPE(o);
  PyObject *d = _PyType_Lookup(t, name); /* borrowed; gives the type a version tag where it can have one */
  site->off = -1;
  /* a plain slot (an object member, no flags) of t or a base of t, in a type that reads and writes attributes as
   * object does and has a version tag (PyType_Modified sets it to 0: a changed class is looked up again) */
  if (d && Py_IS_TYPE(d, &PyMemberDescr_Type) && PyType_IsSubtype(t, PyDescr_TYPE(d)) &&
      ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX && ((PyMemberDescrObject *)d)->d_member->flags == 0 &&
      t->tp_getattro == PyObject_GenericGetAttr && t->tp_setattro == PyObject_GenericSetAttr && t->tp_version_tag)
    site->off = ((PyMemberDescrObject *)d)->d_member->offset;
  Py_XSETREF(site->type, (PyTypeObject *)Py_NewRef(t));
  site->version = t->tp_version_tag;
}

/* The address of `o`'s slot `name`, found through `site`; NULL where `name` is not a plain slot of o's type (a
 * property, a class attribute, an entry of the instance dict, a type with its own __getattribute__ or
 * __setattr__). */
static inline PyObject **slot_of(PyObject *o, PyObject *name, attr_site *site) {
  PyTypeObject *t = Py_TYPE(o);
  if (__builtin_expect(t != site->type || t->tp_version_tag != site->version, 0)) find_slot(o, name, site);
  return site->off < 0 ? NULL : (PyObject **)((char *)o + site->off);
}

/* o.name (a new reference): read where it lies for a slot that is set, else getattr(o, name). */
static inline PyObject *get_attr(PyObject *o, PyObject *name, attr_site *site) {
  PyObject **slot = slot_of(o, name, site);
  return slot && *slot ? Py_NewRef(*slot) : PyObject_GetAttr(o, name);
}

/* o.name = value: 0, or -1 on error. */
static int set_attr(PyObject *o, PyObject *name, PyObject *value, attr_site *site) {
  PyObject **slot = slot_of(o, name, site);
  if (!slot) return PyObject_SetAttr(o, name, value);
  Py_XSETREF(*slot, Py_NewRef(value));
  return 0;
}

/* o.name, each call site with a site of its own */
#define ATTR(o, name) \
  ({ \
    static attr_site site_; \
    get_attr((o), (name), &site_); \
  })

/* o.name = value, each call site with a site of its own */
#define SET_ATTR(o, name, value) \
  ({ \
    static attr_site site_; \
    set_attr((o), (name), (value), &site_); \
  })

/* An int below 2**64 as a uint64_t; (uint64_t)-1 with OverflowError or TypeError set where it is not one. */
static uint64_t as_u64(PyObject *v) {
#if ULONG_MAX == UINT64_MAX
  return PyLong_AsUnsignedLong(v); /* a loop over its digits, where the long long form packs bytes */
#else
  return PyLong_AsUnsignedLongLong(v);
#endif
}

/* A tuple of `n` objects, each a new reference it takes (also on failure); NULL where one is NULL or it could not
 * be made. */
static PyObject *tuple_of(Py_ssize_t n, ...) {
  PyObject *t = PyTuple_New(n);
  int failed = !t;
  va_list items;
  va_start(items, n);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *item = va_arg(items, PyObject *);
    if (!item) failed = 1;
    if (t) PyTuple_SET_ITEM(t, i, item);
    else Py_XDECREF(item);
  }
  va_end(items);
  if (failed) Py_CLEAR(t);
  return t;
}

/* `t` (a new tuple, or NULL), no longer tracked by the garbage collector where each of its items is an object the
 * collector never tracks or an untracked tuple (the collector's own rule for tuples: an untracked dict may become
 * tracked later, a tuple never does): a tuple that can be in no reference cycle, which the collector would
 * otherwise find out on its first pass. */
static PyObject *untracked(PyObject *t) {
  if (!t) return NULL;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
    PyObject *item = PyTuple_GET_ITEM(t, i);
    if (PyObject_IS_GC(item) && !(PyTuple_CheckExact(item) && !PyObject_GC_IsTracked(item))) return t;
  }
  PyObject_GC_UnTrack(t);
  return t;
}

/* Whether `o` is the int 0, exactly (no error set either way: an int beyond a long only flags its overflow). */
static int is_zero(PyObject *o) {
  int overflow = 0;
  return PyLong_CheckExact(o) && PyLong_AsLongAndOverflow(o, &overflow) == 0 && !overflow;
}

/* A new reference to `o`; a tuple among them untracked where `untracked` would untrack it (the kernel's argument
 * tuple, made by the caller: the collector does the same on its first pass). */
static PyObject *untracked_ref(PyObject *o) {
  return PyTuple_CheckExact(o) && PyObject_GC_IsTracked(o) ? untracked(Py_NewRef(o)) : Py_NewRef(o);
}

/* [cmd], taking the reference to `cmd` (also on failure); NULL where it is NULL or the list could not be made. */
static PyObject *one_command(PyObject *cmd) {
  PyObject *list = cmd ? PyList_New(1) : NULL;
  if (list) PyList_SET_ITEM(list, 0, cmd);
  else Py_XDECREF(cmd);
  return list;
}

static PyObject *s_entries;

/* Whether `o` is an Op (whose slots SLOT reads); else a TypeError naming `what`. */
static int is_op(PyObject *o, const char *what) {
  if (PyObject_TypeCheck(o, g_op_type)) return 1;
  PyErr_Format(PyExc_TypeError, "%s holds %R where an op was expected", what, o);
  return 0;
}

/* Whether `entry` is a hazard log entry: (start, end, is_write, op); else a TypeError. */
static int is_entry(PyObject *entry) {
  if (PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 4) return is_op(PyTuple_GET_ITEM(entry, 3), "a hazard log");
  PyErr_Format(PyExc_TypeError, "a hazard log holds %R where (start, end, is_write, op) was expected", entry);
  return 0;
}

static void set_slot(PyObject *op, int s, PyObject *value) {
  PyObject *old = SLOT(op, s);
  Py_INCREF(value);
  SLOT(op, s) = value;
  Py_XDECREF(old);
}

static PyObject *s_log, *s_offset, *s_nbytes, *s_signal, *s_ptr, *s_timeout, *s_closed, *s_lock,
    *s_inflight, *s_done, *s_dispatched, *s_address, *s_python, *s_thread, *s_python_runs,
    *s_check_open, *s_acquire, *s_release, *s_append, *s_failures_seen, *s_failed, *s_state, *s_open,
    *s_enabled, *s_device, *s_plan, *s_outs, *s_name, *s_compute, *s_copy, *s_base, *s_handle, *s_generation,
    *s_owner, *s_dtype, *s_copy_fn, *s_inline, *s_fast_state, *s_retire_lock, *s_popleft, *s_gate, *s_admit, *s_pended, *s_pended_keep, *s_pended_at,
    *s_retire_python, *s_cell_at, *s_cells, *s_cells_pin, *s_held, *s_request_var, *s_own_gate, *s_waiting, *s_window,
    *s_sched_open, *s_queued, *s_queue, *s_priority, *s_fast, *s_locked, *s_drop_unsubmitted, *s_resolve_when_handed_on;

/* ---- engines: what never changes while a native engine lives, in an object it holds (its `_fast_state`) ---- */

typedef struct {
  PyObject_HEAD
  uint64_t *signal;            /* its signal's value */
  void *core;                  /* the core's engine */
  uint64_t *failures;          /* the count of failures the core logged */
  PyObject *lock, *retire_lock; /* its submission and retire locks */
  PyObject *inflight, *append, *popleft;     /* its `_inflight` deque of ops, and two of its methods */
  PyObject *keeps, *keep_append, *keep_popleft; /* its `_inflight_keep` deque: what their records keep alive */
  PyObject *python;            /* its `_python` dict */
  PyObject *failed;            /* its `_failed` dict */
} engine_state;

#define STATE_OBJECTS 10 /* the objects it holds, from `lock` on */

static PyObject **state_objects(engine_state *st) { return &st->lock; }

static void state_dealloc(PyObject *self) {
  engine_state *st = (engine_state *)self;
  for (int i = 0; i < STATE_OBJECTS; i++) Py_CLEAR(state_objects(st)[i]);
  Py_TYPE(self)->tp_free(self);
}

static PyTypeObject state_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aruntime.engine.native.submit.EngineState",
    .tp_basicsize = sizeof(engine_state),
    .tp_dealloc = state_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What the submission path keeps of a native engine: its signal, core, locks, queues and dicts.",
};

/* A native engine's state (borrowed: alive while the engine holds it); NULL with an error set where it has none. */
static engine_state *state_of(PyObject *engine) {
  PyObject *st = ATTR(engine, s_fast_state);
  if (!st) return NULL;
  int ok = Py_IS_TYPE(st, &state_type);
  Py_DECREF(st); /* where it is one, the engine holds it */
  if (ok) return (engine_state *)st;
  PyErr_Format(PyExc_TypeError, "%R holds no native engine state", engine);
  return NULL;
}

/* Call `fn` with no arguments, keeping an error already set: `rc`, or -1 if the call failed. */
static int call_keeping_error(PyObject *fn, int rc) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject *r = PyObject_CallNoArgs(fn);
  if (!r) {
    rc = -1;
    if (type) PyErr_Clear(); /* the first error is the one to raise */
  }
  Py_XDECREF(r);
  if (type) PyErr_Restore(type, value, traceback);
  return rc;
}

/* ---- locks: a threading.Lock whose acquire and release C reaches without a call ------------------------ */

typedef struct {
  PyObject_HEAD
  PyThread_type_lock lock;
  char locked;
} lock_object;

/* how many of this module's Locks the calling thread holds (held_here) */
static _Thread_local int t_held;

static PyTypeObject lock_type;

/* Take `lock`, a Lock of this module: 0, or -1 (a signal handler raised while it waited). One that is busy is waited
 * for with the GIL released and signal handlers run meanwhile, as threading.Lock does. */
static int lock_take(PyObject *lock) {
  lock_object *l = (lock_object *)lock;
  if (!PyThread_acquire_lock(l->lock, NOWAIT_LOCK)) {
    PyLockStatus got;
    do {
      Py_BEGIN_ALLOW_THREADS
      got = PyThread_acquire_lock_timed(l->lock, -1, 1);
      Py_END_ALLOW_THREADS
      if (got == PY_LOCK_INTR && Py_MakePendingCalls() < 0) return -1;
    } while (got != PY_LOCK_ACQUIRED);
  }
  l->locked = 1;
  t_held++;
  return 0;
}

/* Let go of `lock`, a Lock of this module taken by lock_take, keeping an error already set: `rc`, or -1 with a
 * RuntimeError where it is not held (let go of already). */
static int lock_give(PyObject *lock, int rc) {
  lock_object *l = (lock_object *)lock;
  if (!l->locked) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
    return -1;
  }
  l->locked = 0;
  t_held--;
  PyThread_release_lock(l->lock);
  return rc;
}

/* Take `lock`, this module's Lock or any object with acquire() and release(): 0 with what lets it go in `release`
 * (NULL for this module's Lock; had before it is taken), or -1. */
static int any_take(PyObject *lock, PyObject **release) {
  *release = NULL;
  if (Py_IS_TYPE(lock, &lock_type)) return lock_take(lock);
  if (!(*release = PyObject_GetAttr(lock, s_release))) return -1;
  PyObject *r = PyObject_CallMethodNoArgs(lock, s_acquire);
  if (!r) Py_CLEAR(*release);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

/* Let go of what any_take took, keeping an error already set: `rc`, or -1. */
static int any_give(PyObject *lock, PyObject *release, int rc) {
  if (!release) return lock_give(lock, rc);
  rc = call_keeping_error(release, rc);
  Py_DECREF(release);
  return rc;
}

static PyObject *lock_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
    PyErr_SetString(PyExc_TypeError, "Lock() takes no arguments");
    return NULL;
  }
  lock_object *l = (lock_object *)type->tp_alloc(type, 0);
  if (!l) return NULL;
  l->lock = PyThread_allocate_lock();
  if (!l->lock) {
    Py_DECREF(l);
    return PyErr_NoMemory();
  }
  return (PyObject *)l;
}

static void lock_dealloc(PyObject *self) {
  lock_object *l = (lock_object *)self;
  if (l->lock) {
    if (l->locked) PyThread_release_lock(l->lock);
    PyThread_free_lock(l->lock);
  }
  Py_TYPE(self)->tp_free(self);
}

static PyObject *lock_acquire(PyObject *self, PyObject *unused) {
  (void)unused;
  return lock_take(self) ? NULL : Py_NewRef(Py_True);
}

static PyObject *lock_release(PyObject *self, PyObject *unused) {
  (void)unused;
  return lock_give(self, 0) ? NULL : Py_NewRef(Py_None);
}

static PyObject *lock_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)args;
  (void)nargs;
  return lock_release(self, NULL);
}

static PyObject *lock_locked(PyObject *self, PyObject *unused) {
  (void)unused;
  return PyBool_FromLong(((lock_object *)self)->locked);
}

static PyMethodDef lock_methods[] = {
    {"acquire", lock_acquire, METH_NOARGS, "acquire(): take the lock, waiting (the GIL released) while it is held; True"},
    {"release", lock_release, METH_NOARGS, "release(): let go of the lock (a RuntimeError if it is not held)"},
    {"locked", lock_locked, METH_NOARGS, "locked(): whether the lock is held"},
    {"__enter__", lock_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))lock_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject lock_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aruntime.engine.native.submit.Lock",
    .tp_basicsize = sizeof(lock_object),
    .tp_dealloc = lock_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A lock like threading.Lock (acquire() blocks, no timeout), which this module takes and lets go of "
              "without a call.",
    .tp_methods = lock_methods,
    .tp_new = lock_new,
};

/* Take native `engine`'s submission lock (`retire`: its retire lock): 0, or -1. */
static int engine_take(PyObject *engine, int retire) {
  engine_state *st = state_of(engine);
  return st ? lock_take(retire ? st->retire_lock : st->lock) : -1; /* state() checked they are this module's */
}

/* Let go of the lock engine_take took, keeping an error already set: `rc`, or -1 if it could not be let go. */
static int engine_give(PyObject *engine, int retire, int rc) {
  engine_state *st = state_of(engine); /* found by engine_take */
  return lock_give(retire ? st->retire_lock : st->lock, rc);
}

/* ---- ops --------------------------------------------------------------------------------------------- */

static uint64_t op_value(PyObject *op) { /* its value slot, an int below 2**64 */
  PyObject *v = SLOT(op, S_VALUE);
  return v ? as_u64(v) : 0;
}

/* The native signal value of a native engine (its signal's ptr), or -1 with no error set for another engine. */
static int signal_value(PyObject *engine, uint64_t *out) {
  if (Py_TYPE(engine) != g_native_type) return -1;
  engine_state *st = state_of(engine);
  if (!st) return -2;
  *out = __atomic_load_n(st->signal, __ATOMIC_ACQUIRE);
  return 0;
}

/* Whether native `engine` has no failure that Python has not set on its op yet (NativeEngine.retire): the core
 * logs a failure before the op's value is reached, so a reached op of such an engine did not fail. 1, 0, -1. */
static int failures_settled(PyObject *engine) {
  engine_state *st = state_of(engine);
  PyObject *seen = NULL, *failed = NULL;
  int rc = -1;
  if (!st) return -1;
  uint64_t count = __atomic_load_n(st->failures, __ATOMIC_ACQUIRE);
  seen = ATTR(engine, s_failures_seen);
  failed = seen ? Py_NewRef(st->failed) : NULL;
  if (!failed) goto out;
  unsigned long long n = as_u64(seen);
  if (PyErr_Occurred()) goto out;
  rc = n == count && PyDict_Check(failed) && PyDict_GET_SIZE(failed) == 0;
out:
  if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a native engine's failure log is unreadable");
  Py_XDECREF(failed);
  Py_XDECREF(seen);
  return rc;
}

static uint64_t *cell_address(PyObject *op);

/* Op._resolve for an op of `engine` pending in its core, which the core has handed to its queue with `value` (the
 * word of its cell, not ABANDONED), where nothing waits for its dispatch or end yet: its value taken under the ops'
 * lock and the op dropped from its engine's held set. 1 taken (or taken by another thread), 0 Python's (something
 * waits: Op._resolve runs it), -1. */
static int take_value(PyObject *op, PyObject *engine, uint64_t value) {
  PyObject *r = PyObject_CallNoArgs(g_later_acquire);
  if (!r) return -1;
  Py_DECREF(r);
  int rc = 1, taken = 0;
  uint64_t now = op_value(op);
  if (now == (uint64_t)-1 && PyErr_Occurred()) rc = -1;
  else if (now == g_held) { /* else another thread took it */
    PyObject *later = SLOT(op, S_LATER);
    if (later != Py_None && PyObject_Length(later) != 0) rc = PyErr_Occurred() ? -1 : 0;
    else {
      PyObject *v = PyLong_FromUnsignedLongLong(value);
      if (v) {
        set_slot(op, S_VALUE, v);
        set_slot(op, S_LATER, Py_None);
        Py_DECREF(v);
        taken = 1;
      } else rc = -1;
    }
  }
  rc = call_keeping_error(g_later_release, rc);
  if (taken && rc == 1) { /* engine.held.discard(op): a set, as pend_op made it hold the op */
    PyObject *held = ATTR(engine, s_held);
    if (!held || !PySet_Check(held) || PySet_Discard(held, op) < 0) rc = -1;
    if (held && !PySet_Check(held)) PyErr_SetString(PyExc_TypeError, "a native engine's held ops must be a set");
    Py_XDECREF(held);
  }
  return rc;
}

/* For a held op of `engine`: 0 not handed to its queue (held off any queue, or pending in the core), 1 handed on by
 * the core with its value taken (here, where nothing waits for it, or by another thread), 2 handed on or abandoned
 * where Python's Op._resolve must take it (something waits, or the core abandoned it), -1. */
static int handed_on(PyObject *op, PyObject *engine) {
  if (SLOT(op, S_CELL) == Py_None) return 0;
  uint64_t *cell = cell_address(op);
  if (!cell) return -1;
  uint64_t word = __atomic_load_n(cell, __ATOMIC_ACQUIRE);
  if (!word) return 0;
  int taken = word == g_abandoned ? 0 : take_value(op, engine, word);
  return taken ? taken : 2;
}

/* Op.done(): 1, 0, or -1 on error. A retired op of a native engine, an op held (pending in the core or not) that
 * is not handed on yet, and one the core has handed on where nothing waits for it (its value taken here, as
 * Op._resolve does) are read here; anything else asks Op.done. */
static int op_done(PyObject *op) {
  PyObject *engine = SLOT(op, S_ENGINE);
  if (engine == Py_None) return 0;
  uint64_t value = op_value(op);
  if (value == (uint64_t)-1 && PyErr_Occurred()) return -1;
  if (value == g_held) {
    int handed = handed_on(op, engine);
    if (handed <= 0) return handed;
    if (handed == 1) value = op_value(op); /* the core's word, or what another thread set first */
    if (value == (uint64_t)-1 && PyErr_Occurred()) return -1;
  }
  if (value != g_held) {
    uint64_t reached;
    int r = signal_value(engine, &reached);
    if (r == -2) return -1;
    if (r == 0 && (reached < value || SLOT(op, S_CMDS) == Py_None)) return reached >= value;
    if (r == 0) { /* done, not retired: its error is known (None) unless a failure is yet to be set */
      int known = failures_settled(engine);
      if (known) return known < 0 ? -1 : 1;
    }
  }
  PyObject *res = PyObject_CallMethodNoArgs(op, s_done);
  if (!res) return -1;
  int truth = PyObject_IsTrue(res);
  Py_DECREF(res);
  return truth;
}

/* Op.dispatched: 1, 0, -1. */
static int op_dispatched(PyObject *op) {
  PyObject *engine = SLOT(op, S_ENGINE);
  if (engine == Py_None) return 0;
  uint64_t value = op_value(op);
  if (value == (uint64_t)-1 && PyErr_Occurred()) return -1;
  if (value != g_held) return 1;
  int handed = handed_on(op, engine);
  if (handed < 2) return handed;
  PyObject *d = PyObject_GetAttr(op, s_dispatched); /* Op._resolve runs what waits for it, or abandons it */
  int truth = d ? PyObject_IsTrue(d) : -1;
  Py_XDECREF(d);
  return truth;
}

static int contains(PyObject *list, PyObject *item) {
  Py_ssize_t n = PyList_GET_SIZE(list);
  for (Py_ssize_t i = 0; i < n; i++)
    if (PyList_GET_ITEM(list, i) == item) return 1;
  return 0;
}


/* AccessLog.access (memory/hazards.py) of all of `buf`, the same rules: -1 on error. The entries it keeps are
 * kept in the log's list itself (no new list per access); a list that changed meanwhile (another thread's access
 * while this one ran Python) is replaced by a new one, as Python does. */
static int log_access(PyObject *buf, int write, int consumes, PyObject *op, PyObject *engine, PyObject *deps,
                      PyObject *inputs) {
  PyObject *log = ATTR(buf, s_log);
  if (!log) return -1;
  PyObject *off = ATTR(buf, s_offset), *size = off ? ATTR(buf, s_nbytes) : NULL;
  PyObject *entries = size ? ATTR(log, s_entries) : NULL, *end_obj = NULL, *mine = NULL, *now = NULL;
  PyObject *few[16], **seen = few; /* the entries as they were, each held */
  char few_kept[16], *kept = few_kept;
  Py_ssize_t n = 0;
  int rc = -1;
  if (!entries) goto out;
  if (!PyList_Check(entries)) {
    PyErr_SetString(PyExc_TypeError, "a hazard log's entries must be a list");
    goto out;
  }
  long long start = PyLong_AsLongLong(off), end = start + PyLong_AsLongLong(size);
  if (PyErr_Occurred()) goto out;
  Py_ssize_t count = PyList_GET_SIZE(entries);
  if (count > 16 && !(seen = PyMem_Malloc(count * (sizeof *seen + 1)))) {
    seen = few;
    PyErr_NoMemory();
    goto out;
  }
  if (count > 16) kept = (char *)(seen + count);
  for (; n < count; n++) seen[n] = Py_NewRef(PyList_GET_ITEM(entries, n));
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *entry = seen[i];
    kept[i] = 0;
    if (!is_entry(entry)) goto out;
    long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0)), e = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
    int w = PyTuple_GET_ITEM(entry, 2) == Py_True;
    PyObject *other = PyTuple_GET_ITEM(entry, 3);
    if (PyErr_Occurred()) goto out;
    int done = op_done(other);
    if (done < 0) goto out;
    if (done && !(w && SLOT(other, S_ERROR) != Py_None)) continue; /* finished and valid */
    int overlap = s < end && start < e;
    if (done) { /* a failed write */
      if (consumes && overlap && !contains(inputs, other) && PyList_Append(inputs, other)) goto out;
    } else {
      if ((write || w) && overlap && other != op && !contains(deps, other) && PyList_Append(deps, other)) goto out;
      if (consumes && w && overlap && other != op && !contains(inputs, other) && PyList_Append(inputs, other))
        goto out;
    }
    int covered = start <= s && e <= end;
    if (covered && !write) covered = !w && SLOT(other, S_ENGINE) == engine ? op_dispatched(other) : 0;
    if (covered < 0) goto out;
    kept[i] = !covered;
  }
  end_obj = PyLong_FromLongLong(end);
  mine = end_obj ? PyTuple_Pack(4, off, end_obj, write ? Py_True : Py_False, op) : NULL;
  now = mine ? ATTR(log, s_entries) : NULL;
  if (!now) goto out;
  int same = now == entries && PyList_GET_SIZE(entries) == n;
  for (Py_ssize_t i = 0; same && i < n; i++) same = PyList_GET_ITEM(entries, i) == seen[i];
  if (same) { /* the list as it was: the entries it keeps moved to its front, the others let go below */
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
      if (kept[i]) PyList_SET_ITEM(entries, j++, seen[i]);
      else Py_DECREF(seen[i]); /* the list's reference; `seen` still holds one */
    }
    Py_SET_SIZE(entries, j);
    rc = PyList_Append(entries, mine);
  } else { /* changed meanwhile: a new list, as Python's access makes */
    PyObject *live = PyList_New(0);
    rc = live ? 0 : -1;
    for (Py_ssize_t i = 0; !rc && i < n; i++)
      if (kept[i]) rc = PyList_Append(live, seen[i]);
    if (!rc) rc = PyList_Append(live, mine) || SET_ATTR(log, s_entries, live) ? -1 : 0;
    Py_XDECREF(live);
  }
out:
  for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(seen[i]);
  if (seen != few) PyMem_Free(seen);
  Py_XDECREF(now);
  Py_XDECREF(mine);
  Py_XDECREF(end_obj);
  Py_XDECREF(entries);
  Py_XDECREF(size);
  Py_XDECREF(off);
  Py_DECREF(log);
  return rc;
}

/* A new Op(name, (), keep, result), as Op.__init__ makes it, held for `engine` (Op.hold, without the engine's held
 * set): bound before another thread can find it in a hazard log or a window, as BaseDevice._submit binds it. */
static PyObject *new_op(PyObject *engine, PyObject *name, PyObject *keep, PyObject *result) {
  PyObject *id = PyIter_Next(g_op_ids);
  if (!id) return NULL;
  PyObject *op = g_op_type->tp_alloc(g_op_type, 0);
  if (!op) {
    Py_DECREF(id);
    return NULL;
  }
  PyObject *zero = PyLong_FromLong(0), *empty = PyTuple_New(0);
  set_slot(op, S_NAME, name);
  set_slot(op, S_DEPS, empty);
  set_slot(op, S_INPUTS, empty);
  set_slot(op, S_KEEP, keep);
  set_slot(op, S_RESULT, result);
  set_slot(op, S_ERROR, Py_None);
  set_slot(op, S_OBSERVED, Py_False);
  set_slot(op, S_ENGINE, engine);
  set_slot(op, S_CMDS, Py_None);
  set_slot(op, S_VALUE, g_held_value);
  set_slot(op, S_LATER, empty);
  set_slot(op, S_CELL, Py_None);
  set_slot(op, S_AT, zero);
  set_slot(op, S_PEND, zero);
  set_slot(op, S_GATE, Py_None);
  set_slot(op, S_ID, id);
  Py_DECREF(zero);
  Py_DECREF(empty);
  Py_DECREF(id);
  return op;
}

/* ---- records ------------------------------------------------------------------------------------------ */

/* The work record of command `cmd` (kind, a, b, c), or 0 where the worker cannot run it without Python. */
static int work_record(PyObject *cmd, ar_cmd *rec) {
  if (!PyTuple_Check(cmd) || PyTuple_GET_SIZE(cmd) < 4) return 0;
  long kind = PyLong_AsLong(PyTuple_GET_ITEM(cmd, 0));
  if (kind == -1 && PyErr_Occurred()) return -1;
  PyObject *fn = PyTuple_GET_ITEM(cmd, 2);
  memset(rec, 0, sizeof *rec);
  if (kind == C_EXEC && Py_TYPE(fn) == g_entry_type) {
    PyObject *args = PyTuple_GET_ITEM(cmd, 3);
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 2) return 0;
    PyObject *address = ATTR(fn, s_address);
    if (!address) return -1;
    rec->kind = K_EXEC;
    rec->a = as_u64(address);
    rec->b = as_u64(PyTuple_GET_ITEM(args, 1));
    Py_DECREF(address);
    return PyErr_Occurred() ? -1 : 1;
  }
  PyObject *key = PyLong_FromVoidPtr(fn);
  if (!key) return -1;
  int nothing = PyDict_Contains(g_nothing, key), native = nothing == 0 ? PyDict_Contains(g_native_copies, key) : 0;
  Py_DECREF(key);
  if (nothing < 0 || native < 0) return -1;
  if (nothing) {
    rec->kind = K_NOP;
  } else if (kind == C_COPY && native && PyTuple_GET_SIZE(cmd) == 6) {
    rec->kind = K_COPY;
    rec->a = as_u64(PyTuple_GET_ITEM(cmd, 3));
    rec->b = as_u64(PyTuple_GET_ITEM(cmd, 4));
    rec->c = as_u64(PyTuple_GET_ITEM(cmd, 5));
  } else {
    return 0;
  }
  return PyErr_Occurred() ? -1 : 1;
}

static int engine_closed(PyObject *engine) {
  PyObject *closed = ATTR(engine, s_closed);
  if (!closed) return -1;
  int truth = PyObject_IsTrue(closed);
  Py_DECREF(closed);
  return truth;
}

/* Whether `keep` (what an op's records keep alive) holds a timestamp slot to fill in (a tuple): Python's. */
static int takes_timestamps(PyObject *keep) {
  if (keep == Py_None) return 0;
  if (!PyTuple_Check(keep) && !PyList_Check(keep)) return 1;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keep); i++)
    if (PyTuple_Check(PySequence_Fast_ITEMS(keep)[i])) return 1;
  return 0;
}

/* What _retire_op clears on a finished op of a settled engine (`python`: its dict of the ops the Python thread
 * may be asked about). 0, or -1 on error. */
static int clear_op(PyObject *op, PyObject *empty, PyObject *python) {
  if (PyDict_GET_SIZE(python) && PyDict_DelItem(python, SLOT(op, S_ID))) {
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
    PyErr_Clear();
  }
  set_slot(op, S_KEEP, Py_None);
  set_slot(op, S_CMDS, Py_None);
  set_slot(op, S_DEPS, empty);
  set_slot(op, S_INPUTS, empty);
  return 0;
}

/* The oldest ops pending in the core (`_pended`, with `_pended_keep`) that the signal has passed (`reached`), retired
 * as NativeEngine.retire does, up to the first that it has not: the core hands them on in about the order they
 * came, so a batch of them costs what it retires, not what is still pending (one not yet handed on keeps those
 * after it until it is done; none of them can have failed: see retire_plain). 1 done, 0 Python's (an op that
 * takes timestamps, lists not as Python keeps them; those before it retired), -1. Under the retire lock. */
static int retire_pended(PyObject *engine, uint64_t reached, PyObject *empty, PyObject *python) {
  PyObject *ops = ATTR(engine, s_pended), *keeps = ops ? ATTR(engine, s_pended_keep) : NULL;
  PyObject *at = keeps ? ATTR(engine, s_pended_at) : NULL;
  PyObject *cells = NULL;
  int rc = -1;
  if (!at) goto out;
  rc = 0;
  if (!PyList_Check(ops) || !PyList_Check(keeps) || PyList_GET_SIZE(ops) != PyList_GET_SIZE(keeps)) goto out;
  Py_ssize_t n = PyList_GET_SIZE(ops), i = 0;
  rc = 1;
  if (!n) goto out;
  unsigned long long seen = as_u64(at); /* -1 (changed since) reads as an error: look */
  if (PyErr_Occurred()) PyErr_Clear();
  else if (seen == reached) {
    rc = -1;
    int stopped = engine_closed(engine);
    if (stopped < 0) goto out;
    rc = 1;
    if (!stopped) goto out; /* nothing new can be done: an op handed on since has a value past `reached` */
  }
  rc = -1;
  PyObject *cell_obj = NULL;
  const uint64_t *cell = NULL;
  Py_ssize_t cell_len = 0;
  for (; i < n; i++) {
    PyObject *op = PyList_GET_ITEM(ops, i), *keep = PyList_GET_ITEM(keeps, i);
    if (!is_op(op, "a queue's pending ops")) goto cut;
    PyObject *c = SLOT(op, S_CELL);
    if (!c) {
      PyErr_Format(PyExc_AttributeError, "%R has no cell", op);
      goto cut;
    }
    if (c != cell_obj) { /* ops share cell arrays: read each one's memory once */
      Py_buffer view;
      if (PyObject_GetBuffer(c, &view, PyBUF_SIMPLE)) goto cut;
      cell = view.buf;
      cell_len = view.len / 8;
      PyBuffer_Release(&view); /* the array is never resized: its words stay where they are */
      cell_obj = c;
      Py_XSETREF(cells, Py_NewRef(c));
    }
    Py_ssize_t index = PyLong_AsSsize_t(SLOT(op, S_AT));
    if (index < 0 || index >= cell_len) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%R: its cell is out of range", op);
      goto cut;
    }
    uint64_t value = __atomic_load_n(&cell[index], __ATOMIC_ACQUIRE);
    if (value == g_abandoned) {
      set_slot(op, S_KEEP, Py_None);
      set_slot(op, S_CMDS, Py_None);
    } else if (!value || value > reached) {
      break;
    } else if (takes_timestamps(keep)) {
      rc = 0;
      goto cut;
    } else if (clear_op(op, empty, python)) {
      goto cut;
    }
  }
  rc = 1;
cut:
  if (i && (PyList_SetSlice(ops, 0, i, NULL) || PyList_SetSlice(keeps, 0, i, NULL))) rc = -1;
  if (rc == 1) {
    PyObject *now = PyLong_FromUnsignedLongLong(reached);
    if (!now || SET_ATTR(engine, s_pended_at, now)) rc = -1;
    Py_XDECREF(now);
  }
out:
  Py_XDECREF(cells);
  Py_XDECREF(at);
  Py_XDECREF(keeps);
  Py_XDECREF(ops);
  return rc;
}

/* NativeEngine.retire where no failure is left to set (the core logs one before it publishes the failed op's
 * value, and `reached` is read before this looks): the finished ops at the head of its `_inflight` and among
 * those pending in its core are cleared as _retire_op does, under the same lock. 1 done, 0 Python's (a failure
 * to set, an op that takes timestamps), -1. */
static int retire_plain(PyObject *engine, uint64_t reached) {
  int settled = failures_settled(engine);
  if (settled <= 0) return settled;
  engine_state *st = state_of(engine);
  if (!st || engine_take(engine, 1)) return -1;
  PyObject *python = st->python, *inflight = st->inflight, *empty = PyTuple_New(0);
  int rc = empty ? 1 : -1;
  while (rc == 1) {
    Py_ssize_t n = PyObject_Length(inflight);
    if (n <= 0) {
      if (n < 0) rc = -1;
      break;
    }
    PyObject *op = PySequence_GetItem(inflight, 0);
    if (!op || !is_op(op, "a queue")) {
      Py_XDECREF(op);
      rc = -1;
      break;
    }
    int mine = op_value(op) <= reached, stamps = 0;
    if (mine) { /* what its records keep alive: the head of `_inflight_keep`, appended before the op */
      PyObject *keep = PySequence_GetItem(st->keeps, 0);
      stamps = keep ? takes_timestamps(keep) : 0;
      Py_XDECREF(keep);
      if (!keep) rc = -1;
    }
    if (mine && !stamps && rc == 1) {
      PyObject *popped = PyObject_CallNoArgs(st->popleft);
      PyObject *kept = popped ? PyObject_CallNoArgs(st->keep_popleft) : NULL;
      if (!kept || clear_op(op, empty, python)) rc = -1;
      Py_XDECREF(kept);
      Py_XDECREF(popped);
    }
    Py_DECREF(op);
    if (stamps && rc == 1) rc = 0;
    if (!mine) break;
  }
  if (rc == 1) rc = retire_pended(engine, reached, empty, python);
  rc = engine_give(engine, 1, rc);
  Py_XDECREF(empty);
  return rc;
}

/* NativeEngine.retire: retire_plain where it can, else the Python method. 0, or -1 on error. */
static int retire_ops(PyObject *engine, uint64_t reached) {
  int rc = retire_plain(engine, reached);
  if (rc) return rc < 0 ? -1 : 0;
  PyObject *res = PyObject_CallMethodNoArgs(engine, s_retire_python);
  if (!res) return -1;
  Py_DECREF(res);
  return 0;
}

/* retire(engine): NativeEngine.retire's work in C where it can (see retire_plain): True, or None for Python. */
static PyObject *retire(PyObject *self, PyObject *engine) {
  (void)self;
  if (Py_TYPE(engine) != g_native_type) Py_RETURN_NONE;
  uint64_t reached;
  if (signal_value(engine, &reached)) return NULL;
  int rc = retire_plain(engine, reached);
  if (rc < 0) return NULL;
  return Py_NewRef(rc ? Py_True : Py_None);
}

/* The address of word `index` of the array of cells `c` (for `op`, named in errors), or NULL with an error. */
static uint64_t *cells_word(PyObject *op, PyObject *c, Py_ssize_t index) {
  /* views of the last arrays of cells looked at, held: ops share arrays of CELLS cells, so a few arrays (the
   * engines' newest) serve most ops, and an array whose view is held cannot be resized meanwhile */
  enum { KEPT = 4 };
  static Py_buffer kept[KEPT];
  static unsigned next;
  uint64_t *words = NULL;
  Py_ssize_t len = 0;
  for (int i = 0; i < KEPT && !words; i++)
    if (kept[i].obj == c) {
      words = kept[i].buf;
      len = kept[i].len / 8;
    }
  if (!words) {
    Py_buffer fresh, old;
    if (PyObject_GetBuffer(c, &fresh, PyBUF_WRITABLE)) return NULL;
    words = fresh.buf;
    len = fresh.len / 8;
    Py_buffer *at = &kept[next++ % KEPT];
    old = *at;
    *at = fresh;
    if (old.obj) PyBuffer_Release(&old); /* last: what letting go of it runs finds the new view in place */
  }
  if (index < 0 || index >= len || !words) {
    PyErr_Format(PyExc_ValueError, "%R: its cell is out of range", op);
    return NULL;
  }
  return words + index;
}

/* The address of the word the core writes a pending op's value into: its cell array's memory, at its index. */
static uint64_t *cell_address(PyObject *op) {
  PyObject *c = SLOT(op, S_CELL);
  Py_ssize_t index = c ? PyLong_AsSsize_t(SLOT(op, S_AT)) : -1;
  if (!c || (index == -1 && PyErr_Occurred())) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_AttributeError, "%R has no cell", op);
    return NULL;
  }
  return cells_word(op, c, index);
}

/* Whether `op` (its inputs recorded) can be appended here: the (engine address, value) pairs of its dependency
 * check into `pairs` (a new bytes object, or NULL where none of its inputs can still fail it; an input pending in
 * its core is named by its cell). 1, 0 (Python's: a held input without a cell, more than 16 inputs), -1. */
static int check_pairs(PyObject *inputs, PyObject **pairs) {
  *pairs = NULL;
  if (!PyTuple_Check(inputs) && !PyList_Check(inputs)) return 0;
  Py_ssize_t ni = PySequence_Fast_GET_SIZE(inputs);
  if (!ni) return 1;
  if (ni > 16) return 0;
  uint64_t buf[2 * 16];
  Py_ssize_t np = 0;
  for (Py_ssize_t i = 0; i < ni; i++) {
    PyObject *dep = PySequence_Fast_GET_ITEM(inputs, i);
    if (!is_op(dep, "an op's inputs")) return -1;
    int done = op_done(dep);
    if (done < 0) return -1;
    uint64_t address = 0, value = 0; /* (0, 0): the worker asks Python */
    if (done) {
      if (SLOT(dep, S_ERROR) == Py_None) continue;
    } else if (Py_TYPE(SLOT(dep, S_ENGINE)) == g_native_type) {
      value = op_value(dep);
      if (value == g_held) { /* pending in its core: the worker reads its value from its cell */
        if (SLOT(dep, S_CELL) == Py_None) return 0;
        uint64_t *cell = cell_address(dep);
        if (!cell) return -1;
        value = (uint64_t)(uintptr_t)cell | TAG;
      }
      engine_state *st = state_of(SLOT(dep, S_ENGINE));
      if (!st) return -1;
      address = (uint64_t)(uintptr_t)st->core;
    }
    buf[np++] = address;
    buf[np++] = value;
  }
  if (np && !(*pairs = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)(np * sizeof(uint64_t)))))
    return -1;
  return 1;
}

/* Whether a profile is being recorded (the op's work record then carries F_RECORD and its name): 1, 0, -1. */
static int recording(void) {
  PyObject *enabled = ATTR(g_recorder, s_enabled);
  int truth = enabled ? PyObject_IsTrue(enabled) : -1;
  Py_XDECREF(enabled);
  return truth;
}


/* Whether a profile is recorded, for an op handed on already: 1 or 0 (an error is reported, not raised). */
static int recording_now(void) {
  int recorded = recording();
  if (recorded < 0) PyErr_WriteUnraisable(g_recorder);
  return recorded > 0;
}

/* Where a profile is recorded: that `op` waited for each of `deps` (a list, NULL after an error) on another queue
 * (its flows), as the Python path records them. The op has been handed on: a failure is reported, not raised. */
static void record_deps(PyObject *op, PyObject *deps) {
  PyObject *r = deps ? PyObject_CallFunctionObjArgs(g_record_deps, op, deps, NULL) : NULL;
  if (!r) PyErr_WriteUnraisable(g_record_deps);
  Py_XDECREF(r);
}
/* The records of `op`'s `cmds` (WAIT commands, then one kernel or copy that the worker runs without Python), as
 * NativeEngine._pack makes them: a wait per WAIT, a dependency check where an input is unfinished (the op is then
 * registered with the engine's Python thread, which the worker asks when an input failed), the work, with
 * `gate` on the first that starts it; into `recs` (`*nrec` of them), what they keep alive into `*keep` (None or
 * a new tuple of bytes, untracked) and what the op keeps of its commands into `*kept` (a new reference: `cmds`, or
 * a lone kernel or copy as numbers, strings and bytes, untracked). 1, 0 before any side effect
 * (Python's), -1. */
static int build_records(PyObject *engine, PyObject *op, PyObject *cmds, uint64_t gate, ar_cmd *recs, int *nrec,
                         PyObject **keep, PyObject **kept) {
  *keep = Py_None;
  *kept = NULL;
  *nrec = 0;
  Py_ssize_t n = PyList_GET_SIZE(cmds);
  if (n < 1 || n > MAX_WAITS + 1) return 0;
  ar_cmd work;
  int kind = work_record(PyList_GET_ITEM(cmds, n - 1), &work);
  if (kind <= 0) return kind;
  int recorded = recording();
  uint32_t name_number = 0;
  if (recorded) { /* a profile is recorded: the number of the work's name (before anything is registered) */
    PyObject *name = recorded > 0 ? PyObject_CallOneArg(g_name_id, PyTuple_GET_ITEM(PyList_GET_ITEM(cmds, n - 1), 1)) : NULL;
    name_number = name ? (uint32_t)PyLong_AsUnsignedLong(name) : 0;
    Py_XDECREF(name);
    if (!name || PyErr_Occurred()) return -1;
  }
  uint64_t id = as_u64(SLOT(op, S_ID));
  if (PyErr_Occurred()) return -1;
  for (Py_ssize_t i = 0; i < n - 1; i++) {
    PyObject *cmd = PyList_GET_ITEM(cmds, i);
    if (!PyTuple_Check(cmd) || PyTuple_GET_SIZE(cmd) != 3 || PyTuple_GET_ITEM(cmd, 0) != g_wait_kind) return 0;
    PyObject *ptr = ATTR(PyTuple_GET_ITEM(cmd, 1), s_ptr);
    PyObject *timeout = ptr ? ATTR(PyTuple_GET_ITEM(cmd, 1), s_timeout) : NULL;
    ar_cmd *rec = &recs[(*nrec)++];
    memset(rec, 0, sizeof *rec);
    rec->kind = K_WAIT;
    rec->a = ptr ? as_u64(ptr) : 0;
    rec->b = as_u64(PyTuple_GET_ITEM(cmd, 2));
    rec->c = timeout ? (uint64_t)(int64_t)(PyFloat_AsDouble(timeout) * 1e9) : 0;
    rec->op = id;
    rec->index = (uint32_t)i;
    Py_XDECREF(timeout);
    Py_XDECREF(ptr);
    if (!timeout || PyErr_Occurred()) { /* not a native signal: Python's */
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
      PyErr_Clear();
      return 0;
    }
  }
  PyObject *pairs;
  int ok = check_pairs(SLOT(op, S_INPUTS), &pairs);
  if (ok <= 0) return ok;
  uint32_t index = (uint32_t)(n - 1);
  if (pairs) {
    ar_cmd *rec = &recs[(*nrec)++];
    memset(rec, 0, sizeof *rec);
    rec->kind = K_CHECK;
    rec->d = gate; /* the first record that starts the op's work reads its request's gate */
    gate = 0;
    rec->a = (uint64_t)(uintptr_t)PyBytes_AS_STRING(pairs);
    rec->b = (uint64_t)(PyBytes_GET_SIZE(pairs) / 16);
    rec->op = id;
    rec->index = index | CHECK_BIT;
    engine_state *st = state_of(engine);
    int failed = !st || PyDict_SetItem(st->python, SLOT(op, S_ID), op);
    PyObject *thread = failed ? NULL : ATTR(engine, s_thread);
    if (thread && thread == Py_None) {
      PyObject *r = PyObject_CallMethodOneArg(engine, s_python_runs, op);
      if (!r) failed = 1;
      Py_XDECREF(r);
    } else if (!thread) {
      failed = 1;
    }
    Py_XDECREF(thread);
    if (failed) Py_DECREF(pairs);
    if (failed || !(*keep = untracked(tuple_of(1, pairs)))) {
      *keep = Py_None;
      return -1;
    }
  }
  ar_cmd *rec = &recs[(*nrec)++];
  *rec = work;
  rec->d = gate;
  rec->flags = F_END;
  rec->op = id;
  rec->index = index;
  if (recorded) { /* its range is recorded, under its command's name */
    rec->flags |= F_RECORD;
    rec->name = name_number;
  }
  if (rec->kind == K_EXEC || rec->kind == K_COPY) { /* as NativeEngine._pack keeps them: see _as_kept */
    PyObject *cmd = PyList_GET_ITEM(cmds, n - 1);
    PyObject *name = Py_NewRef(PyTuple_GET_ITEM(cmd, 1));
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t && i < n - 1; i++) {
      PyObject *wait = PyList_GET_ITEM(cmds, i), *sig = PyTuple_GET_ITEM(wait, 1);
      PyObject *sig_name = ATTR(sig, s_name), *timeout = sig_name ? ATTR(sig, s_timeout) : NULL;
      PyObject *item = untracked(
          tuple_of(4, Py_NewRef(g_wait_kind), sig_name, Py_NewRef(PyTuple_GET_ITEM(wait, 2)), timeout));
      if (!item) Py_CLEAR(t);
      else PyTuple_SET_ITEM(t, i, item);
    }
    PyObject *item = !t ? NULL
                     : rec->kind == K_EXEC
                         ? tuple_of(4, PyLong_FromLong(C_EXEC), name, PyLong_FromUnsignedLongLong(rec->a),
                                    untracked_ref(PyTuple_GET_ITEM(cmd, 3)))
                         : tuple_of(6, PyLong_FromLong(C_COPY), name, Py_NewRef(Py_None),
                                    PyLong_FromUnsignedLongLong(rec->a), PyLong_FromUnsignedLongLong(rec->b),
                                    PyLong_FromUnsignedLongLong(rec->c));
    if (!t) Py_DECREF(name);
    if (item) PyTuple_SET_ITEM(t, n - 1, untracked(item));
    else Py_CLEAR(t);
    *kept = untracked(t);
  } else {
    *kept = Py_NewRef(cmds);
  }
  if (!*kept) {
    if (*keep != Py_None) Py_DECREF(*keep);
    *keep = Py_None;
    return -1;
  }
  return 1;
}

/* Undo build_records' registration of `op` with the engine's Python thread (the op will not run). */
static void unregister(PyObject *engine, PyObject *op) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  engine_state *st = state_of(engine);
  if (st && PyDict_DelItem(st->python, SLOT(op, S_ID))) PyErr_Clear();
  PyErr_Clear();
  PyErr_Restore(type, value, traceback);
}

/* retire_window(inflight, failed): Scheduler._retire, under the scheduler's lock: the done ops at the head of
 * `inflight` (its window, a deque of ops) dropped, those that failed appended to `failed` (a list); None. */
static PyObject *retire_window(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 2 || !PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "retire_window(inflight: a deque of ops, failed: a list)");
    return NULL;
  }
  PyObject *inflight = args[0], *failed = args[1];
  for (;;) {
    Py_ssize_t n = PyObject_Length(inflight);
    if (n <= 0) {
      if (n < 0) return NULL;
      break;
    }
    PyObject *op = PySequence_GetItem(inflight, 0);
    if (!op) return NULL;
    int done = is_op(op, "a scheduler's window") ? op_done(op) : -1;
    if (done > 0) {
      PyObject *popped = PyObject_CallMethodNoArgs(inflight, s_popleft);
      if (!popped) done = -1;
      Py_XDECREF(popped);
      if (done > 0 && SLOT(op, S_ERROR) != Py_None && PyList_Append(failed, op)) done = -1;
    }
    Py_DECREF(op);
    if (done < 0) return NULL;
    if (!done) break;
  }
  Py_RETURN_NONE;
}

/* NativeEngine._enqueue for `op`, bound for native `engine` with `cmds`, under the engine's lock: its records
 * (build_records) appended through ar_submit, the op's value set and the op kept in flight; finished ops retired
 * in batches first. Sets op.engine and op.cmds (an op handed on keeps no deps: its waits are in the ring); `flows`
 * (a list, or NULL): the ops a profile records it waited for, recorded before its records can run. 1, 0 before any side effect
 * (Python's), -1 on error. */
static int append_records(PyObject *engine, PyObject *op, PyObject *cmds, uint64_t gate, PyObject *flows) {
  ar_cmd recs[MAX_RECORDS];
  int nrec;
  PyObject *keep, *kept;
  int ok = build_records(engine, op, cmds, gate, recs, &nrec, &keep, &kept);
  if (ok <= 0) return ok;
  engine_state *st = state_of(engine);
  PyObject *inflight = st ? st->inflight : NULL;
  int rc = -1;
  if (!inflight) goto out;
  Py_ssize_t queued = PyObject_Length(inflight);
  if (queued >= RETIRE_EVERY) { /* NativeEngine._enqueue: retire in batches, then append */
    PyObject *head = PySequence_GetItem(inflight, 0);
    uint64_t reached;
    int r = head ? signal_value(engine, &reached) : -2;
    if (r == 0 && !is_op(head, "a queue")) r = -2;
    if (r == 0 && op_value(head) <= reached && retire_ops(engine, reached)) r = -2;
    Py_XDECREF(head);
    if (r == -2 || PyErr_Occurred()) goto out;
  }
  set_slot(op, S_ENGINE, engine);
  set_slot(op, S_CMDS, kept);
  if (flows) record_deps(op, flows); /* before it can run, as Python records them */
  uint64_t value = g_submit(st->core, recs, (uint32_t)nrec);
  if (!value) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_MemoryError, "%U: no memory for the commands of its queue", SLOT(op, S_NAME));
    goto out;
  }
  PyObject *v = PyLong_FromUnsignedLongLong(value);
  if (!v) goto out;
  set_slot(op, S_VALUE, v);
  Py_DECREF(v);
  PyObject *appended = PyObject_CallOneArg(st->keep_append, keep); /* before the op: see retire_plain */
  if (!appended) goto out;
  Py_DECREF(appended);
  appended = PyObject_CallOneArg(st->append, op);
  if (!appended) { /* the deques stay in step */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *popped = PyObject_CallMethod(st->keeps, "pop", NULL);
    if (!popped) PyErr_Clear();
    Py_XDECREF(popped);
    PyErr_Restore(type, value, traceback);
    goto out;
  }
  Py_DECREF(appended);
  rc = 1;
out:
  if (rc < 0) unregister(engine, op);
  if (keep != Py_None) Py_DECREF(keep);
  Py_DECREF(kept);
  return rc;
}


/* NativeEngine.pend's batch retire: with RETIRE_EVERY or more ops pending in native `engine`'s core and the
 * oldest of them done, the done ones are retired first, as _enqueue does for ops in flight. 0, or -1. */
static int retire_pended_due(PyObject *engine) {
  PyObject *ops = ATTR(engine, s_pended);
  if (!ops) return -1;
  int rc = 0;
  if (PyList_Check(ops) && PyList_GET_SIZE(ops) >= RETIRE_EVERY) {
    PyObject *head = PyList_GET_ITEM(ops, 0);
    uint64_t reached, *cell;
    rc = -1;
    if (is_op(head, "a queue's pending ops") && !signal_value(engine, &reached) && (cell = cell_address(head))) {
      uint64_t value = __atomic_load_n(cell, __ATOMIC_ACQUIRE);
      rc = value == g_abandoned || (value && value <= reached) ? retire_ops(engine, reached) : 0;
    }
  }
  Py_DECREF(ops);
  return rc;
}

typedef struct {
  int on_dispatch;
  PyObject *dep; /* borrowed: held by the op's deps */
} cond_t;

/* What a pending op keeps alive: `keep` (None or a tuple) and `pin`, the view that keeps its array of cells where it
 * is (NativeEngine.pend's rule). New reference. */
static PyObject *keep_with(PyObject *keep, PyObject *pin) {
  if (keep == Py_None) return untracked(tuple_of(1, Py_NewRef(pin)));
  if (!PyTuple_Check(keep)) {
    PyErr_SetString(PyExc_TypeError, "what an op keeps must be a tuple or None");
    return NULL;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(keep);
  PyObject *t = PyTuple_New(n + 1);
  if (!t) return NULL;
  for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(PyTuple_GET_ITEM(keep, i)));
  PyTuple_SET_ITEM(t, n, Py_NewRef(pin));
  return untracked(t);
}

/* NativeEngine.pend in C for `op` and the conditions of dispatch_when_ready's _pend_held: its records handed to
 * native `engine`'s core with a cell (a word of the engine's shared cell array), appended to its queue by the core
 * from whichever thread meets the last condition. 1, 0 before any side effect (Python's), -1. */
static int pend_op(PyObject *engine, PyObject *op, PyObject *body, PyObject *deps, uint64_t gate, cond_t *conds,
                   int nconds) {
  if (engine_take(engine, 0)) return -1;
  ar_cmd recs[MAX_RECORDS];
  int nrec = 0, rc = engine_closed(engine);
  PyObject *keep = Py_None, *kept = NULL, *cells = NULL, *at_obj = NULL, *pin = NULL, *pinned = NULL;
  void *pend = NULL;
  if (rc) { /* closed: Python's (dispatch_when_ready abandons the op) */
    rc = rc < 0 ? -1 : 0;
    goto unlock;
  }
  if (retire_pended_due(engine)) {
    rc = -1;
    goto unlock;
  }
  rc = build_records(engine, op, body, gate, recs, &nrec, &keep, &kept);
  if (rc <= 0) goto unlock;
  rc = -1;
  at_obj = ATTR(engine, s_cell_at);
  Py_ssize_t at = at_obj ? PyLong_AsSsize_t(at_obj) : -1;
  if (at < 0) goto unlock;
  if (at >= g_cells) { /* a new shared array of cells, and its pin (see NativeEngine.pend) */
    cells = PyObject_CallNoArgs(g_new_cells);
    PyObject *fresh_pin = cells ? PyMemoryView_FromObject(cells) : NULL;
    int set = !fresh_pin || SET_ATTR(engine, s_cells, cells) || SET_ATTR(engine, s_cells_pin, fresh_pin);
    Py_XDECREF(fresh_pin);
    if (set) goto unlock;
    at = 0;
  } else if (!(cells = ATTR(engine, s_cells))) {
    goto unlock;
  }
  if (!(pin = ATTR(engine, s_cells_pin)) || !(pinned = keep_with(keep, pin))) goto unlock;
  PyObject *next = PyLong_FromSsize_t(at + 1), *index = next ? PyLong_FromSsize_t(at) : NULL;
  int set = !index || SET_ATTR(engine, s_cell_at, next);
  if (!set) set_slot(op, S_AT, index); /* its cell last, once it has its pend: another thread that finds it
                                          * pending (a cell, held) may hand its pend to the core */
  Py_XDECREF(index);
  Py_XDECREF(next);
  uint64_t *cell = set ? NULL : cells_word(op, cells, at);
  engine_state *st = cell ? state_of(engine) : NULL;
  if (!st) goto unlock;
  set_slot(op, S_ENGINE, engine);
  set_slot(op, S_CMDS, kept);
  if (PyList_GET_SIZE(deps)) set_slot(op, S_DEPS, deps);
  pend = g_pend_new(st->core, recs, (uint32_t)nrec, cell);
  if (!pend) {
    PyErr_Format(PyExc_MemoryError, "%U: no memory for the commands of its queue", SLOT(op, S_NAME));
    goto unlock;
  }
  PyObject *address = PyLong_FromVoidPtr(pend), *held = address ? PyLong_FromUnsignedLongLong(g_held) : NULL;
  PyObject *empty = held ? PyTuple_New(0) : NULL, *holders = empty ? ATTR(engine, s_held) : NULL;
  if (holders) { /* Op.hold: what waits for it already (it was held) keeps waiting */
    set_slot(op, S_PEND, address);
    set_slot(op, S_VALUE, held);
    if (SLOT(op, S_LATER) == Py_None) set_slot(op, S_LATER, empty);
    set_slot(op, S_CELL, cells);
  }
  int added = holders && PySet_Check(holders) && !PySet_Add(holders, op);
  Py_XDECREF(holders);
  Py_XDECREF(empty);
  Py_XDECREF(held);
  Py_XDECREF(address);
  if (!added) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a native engine's held ops must be a set");
    goto unlock;
  }
  if (!engine_take(engine, 1)) { /* the pending lists, as retire() replaces them */
    PyObject *ops = ATTR(engine, s_pended), *keeps = ops ? ATTR(engine, s_pended_keep) : NULL;
    PyObject *minus = keeps ? PyLong_FromLong(-1) : NULL;
    rc = minus && !PyList_Append(ops, op) && !PyList_Append(keeps, pinned) && !SET_ATTR(engine, s_pended_at, minus)
             ? 1
             : -1;
    Py_XDECREF(minus);
    Py_XDECREF(keeps);
    Py_XDECREF(ops);
    rc = engine_give(engine, 1, rc);
  }
unlock:
  rc = engine_give(engine, 0, rc);
  if (rc < 0 && kept) unregister(engine, op);
  Py_XDECREF(at_obj);
  Py_XDECREF(cells);
  Py_XDECREF(pin);
  Py_XDECREF(pinned);
  Py_XDECREF(kept);
  if (keep != Py_None) Py_DECREF(keep);
  if (rc <= 0 || !pend) return rc;
  for (int i = 0; i < nconds; i++) { /* NativeEngine.pend: its conditions, outside the lock */
    PyObject *dep = conds[i].dep;
    engine_state *dst = state_of(SLOT(dep, S_ENGINE));
    if (!dst) return -1; /* not reached: a condition's op runs on a native engine */
    if (SLOT(dep, S_CELL) != Py_None && op_value(dep) == g_held) {
      uint64_t *dep_cell = cell_address(dep);
      PyObject *dep_pend = dep_cell ? SLOT(dep, S_PEND) : NULL;
      void *dp = dep_pend ? PyLong_AsVoidPtr(dep_pend) : NULL;
      if (!dp) return -1;
      g_pend_on_pend(pend, dp, dep_cell, dst->core, !conds[i].on_dispatch);
    } else if (!conds[i].on_dispatch) {
      g_pend_on_sig(pend, dst->signal, op_value(dep));
    }
  }
  if (recording_now()) { /* its flows: the conditions that wait for another queue's op to be done (before it
                           * can be handed on and run, as Python records them) */
    PyObject *waited = PyList_New(0);
    for (int i = 0; waited && i < nconds; i++)
      if (!conds[i].on_dispatch && PyList_Append(waited, conds[i].dep)) Py_CLEAR(waited);
    record_deps(op, waited);
    Py_XDECREF(waited);
  }
  g_pend_go(pend);
  PyObject *later = SLOT(op, S_LATER); /* what waited for it while it was held: run once the core hands it on */
  if (PyList_Check(later) && PyList_GET_SIZE(later)) {
    PyObject *r = PyObject_CallMethodNoArgs(op, s_resolve_when_handed_on);
    Py_XDECREF(r);
    if (!r) return -1;
  }
  return 1;
}

/* dispatch_when_ready's _pend_held in C for a scheduler's `op` (admitted, held): pended in its engine's core with
 * its conditions (a dependency on another native queue done, one on its own queue handed on), or appended at once
 * if nothing blocks it. 1, 0 before any side effect where a dependency cannot be waited for in a core (Python's),
 * -1. */
static int pend_held(PyObject *engine, PyObject *op, PyObject *body, PyObject *deps, uint64_t gate) {
  cond_t conds[MAX_WAITS];
  int nconds = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(deps); i++) {
    PyObject *dep = PyList_GET_ITEM(deps, i);
    int done = op_done(dep);
    if (done < 0) return -1;
    if (done) continue;
    PyObject *dep_engine = SLOT(dep, S_ENGINE);
    if (nconds == MAX_WAITS) return 0;
    if (dep_engine != engine) {
      if (Py_TYPE(dep_engine) != g_native_type) return 0;
      if (SLOT(dep, S_CELL) == Py_None) {
        int dispatched = op_dispatched(dep);
        if (dispatched <= 0) return dispatched;
      }
      conds[nconds].on_dispatch = 0;
      conds[nconds++].dep = dep;
    } else {
      int dispatched = op_dispatched(dep);
      if (dispatched < 0) return -1;
      if (dispatched) continue;
      if (SLOT(dep, S_CELL) == Py_None) return 0;
      conds[nconds].on_dispatch = 1;
      conds[nconds++].dep = dep;
    }
  }
  if (!nconds) {
    if (engine_take(engine, 0)) return -1;
    int rc = engine_closed(engine);
    if (rc == 0) rc = append_records(engine, op, body, gate, NULL);
    else if (rc == 1) rc = 0;
    return engine_give(engine, 0, rc);
  }
  return pend_op(engine, op, body, deps, gate, conds, nconds);
}

typedef struct {
  PyObject *engine; /* borrowed: a dep's, alive while the dep is */
  uint64_t value;
} wait_t;

/* Hand `op` (deps and inputs recorded) to native `engine`, as dispatch_when_ready and push would: a WAIT on
 * each other native queue it depends on, unless it is `held` (a held op with a dependency on another queue
 * waits off its queue: Python's). 1: handed on; 0: not here (the caller finishes in Python); -1: error. Under the
 * engine's lock. */
static int push(PyObject *engine, PyObject *op, PyObject *body, PyObject *deps, int held, uint64_t gate) {
  wait_t waits[MAX_WAITS];
  int nwaits = 0;
  Py_ssize_t nd = PyList_GET_SIZE(deps);
  for (Py_ssize_t i = 0; i < nd; i++) {
    PyObject *dep = PyList_GET_ITEM(deps, i);
    int done = op_done(dep);
    if (done < 0) return -1;
    if (done) continue;
    PyObject *dep_engine = SLOT(dep, S_ENGINE);
    uint64_t value = op_value(dep);
    if (value == g_held || dep_engine == Py_None) return 0; /* not handed on yet: dispatch_when_ready */
    if (dep_engine == engine) continue;                   /* its queue runs in order */
    if (held || Py_TYPE(dep_engine) != g_native_type) return 0; /* a held op waits off its queue: Python's */
    int j = 0;
    while (j < nwaits && waits[j].engine != dep_engine) j++;
    if (j == nwaits) {
      if (nwaits == MAX_WAITS) return 0;
      waits[nwaits].engine = dep_engine;
      waits[nwaits++].value = value;
    } else if (value > waits[j].value) {
      waits[j].value = value;
    }
  }
  if (!nwaits) return append_records(engine, op, body, gate, NULL); /* its commands are `body`, as in Python */
  PyObject *cmds = PyList_New(0);
  int rc = cmds ? 0 : -1;
  for (int i = 0; i < nwaits && !rc; i++) {
    PyObject *sig = ATTR(waits[i].engine, s_signal);
    PyObject *item = sig ? tuple_of(3, Py_NewRef(g_wait_kind), Py_NewRef(sig), PyLong_FromUnsignedLongLong(waits[i].value))
                         : NULL;
    if (!item || PyList_Append(cmds, item)) rc = -1;
    Py_XDECREF(item);
    Py_XDECREF(sig);
  }
  if (!rc && PyList_Append(cmds, PyList_GET_ITEM(body, 0))) rc = -1;
  PyObject *waited = NULL; /* where a profile is recorded, its flows: the ops of the queues it waits for */
  int recorded = rc ? 0 : recording();
  if (recorded < 0) rc = -1;
  if (recorded > 0 && !(waited = PyList_New(0))) rc = -1;
  for (Py_ssize_t i = 0; waited && !rc && i < nd; i++) {
    PyObject *dep = PyList_GET_ITEM(deps, i);
    int j = 0;
    while (j < nwaits && waits[j].engine != SLOT(dep, S_ENGINE)) j++;
    if (j < nwaits && PyList_Append(waited, dep)) rc = -1;
  }
  if (!rc) rc = append_records(engine, op, cmds, gate, waited);
  Py_XDECREF(waited);
  Py_XDECREF(cmds);
  return rc;
}


/* enqueue(engine, cmds, op): NativeEngine._enqueue's work in C where it can (see append_records): True, or
 * None for the Python path. */
static PyObject *enqueue(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "enqueue(engine, cmds, op)");
    return NULL;
  }
  PyObject *engine = args[0], *cmds = args[1], *op = args[2];
  if (Py_TYPE(engine) != g_native_type || !PyList_Check(cmds) || Py_TYPE(op) != g_op_type)
    Py_RETURN_NONE;
  uint64_t gate = 0;
  PyObject *g = SLOT(op, S_GATE);
  if (g != Py_None) {
    Py_buffer view;
    if (PyObject_GetBuffer(g, &view, PyBUF_SIMPLE)) return NULL;
    gate = (uint64_t)(uintptr_t)view.buf;
    PyBuffer_Release(&view);
  }
  int rc = append_records(engine, op, cmds, gate, NULL);
  if (rc < 0) return NULL;
  return Py_NewRef(rc ? Py_True : Py_None);
}

/* ---- the module's functions --------------------------------------------------------------------------- */

/* `value` (an attribute just read), or NULL with no error set where there was no such attribute; NULL with an
 * error otherwise. */
static PyObject *optional(PyObject *value) {
  if (!value && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
  return value;
}

/* Scheduler._gate(): the gate of an op its task submits now. Here where the task is in no request (the context
 * variable `window._request_var` holds None): the scheduler's own gate; else (or for a window that is no
 * Scheduler) Python's rule. New reference. */
static PyObject *window_gate(PyObject *window) {
  PyObject *var = optional(ATTR(window, s_request_var)), *request = NULL;
  if (!var && PyErr_Occurred()) return NULL;
  int rc = var && PyContextVar_CheckExact(var) ? PyContextVar_Get(var, NULL, &request) : 0;
  Py_XDECREF(var);
  if (rc < 0) return NULL;
  if (request == Py_None) {
    Py_DECREF(request);
    return ATTR(window, s_own_gate);
  }
  Py_XDECREF(request);
  PyObject *gate = PyObject_GetAttr(window, s_gate);
  if (!gate && PyErr_ExceptionMatches(PyExc_AttributeError)) { /* dispatch.gate_of's error */
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "window must be a Scheduler or None, got %R", window);
  }
  PyObject *r = gate ? PyObject_CallNoArgs(gate) : NULL;
  Py_XDECREF(gate);
  return r;
}

/* Scheduler._admit((op,)): 1 if the window admits the op now, 0 if not, -1 on error. Here where nothing waits
 * for room and the window is not full (under the scheduler's lock, as Python does); else (or for a window that
 * is no Scheduler) Python's rule, which retires finished ops before it looks. */
static int window_admit(PyObject *window, PyObject *op) {
  PyObject *lock = optional(ATTR(window, s_lock)), *r;
  if (!lock && PyErr_Occurred()) return -1;
  int rc = 0;
  if (lock) { /* a lock that waits with the GIL released */
    PyObject *release;
    if (any_take(lock, &release)) {
      Py_DECREF(lock);
      return -1;
    }
    PyObject *waiting = optional(ATTR(window, s_waiting));
    PyObject *inflight = waiting ? optional(ATTR(window, s_inflight)) : NULL;
    PyObject *limit = inflight ? optional(ATTR(window, s_window)) : NULL;
    if (waiting && inflight && limit && PyLong_Check(limit)) {
      Py_ssize_t queued = PyObject_Length(waiting), held = PyObject_Length(inflight), most = PyLong_AsSsize_t(limit);
      if (queued < 0 || held < 0 || PyErr_Occurred()) {
        rc = -1;
      } else if (queued == 0 && held < most) {
        r = PyObject_CallMethodOneArg(inflight, s_append, op);
        rc = r ? 1 : -1;
        Py_XDECREF(r);
      }
    } else if (PyErr_Occurred()) {
      rc = -1;
    }
    Py_XDECREF(waiting);
    Py_XDECREF(inflight);
    Py_XDECREF(limit);
    rc = any_give(lock, release, rc);
    Py_DECREF(lock);
    if (rc) return rc;
  }
  PyObject *ops = PyTuple_Pack(1, op);
  r = ops ? PyObject_CallMethodOneArg(window, s_admit, ops) : NULL;
  Py_XDECREF(ops);
  rc = r ? PyObject_IsTrue(r) : -1;
  Py_XDECREF(r);
  return rc;
}

/* The words of `gate` in `view` (to release), where it is a gate: ops.new_gate's writable array('q') of 3 words,
 * which the core reads and writes. 0, or -1 with ops.check_gate's TypeError. */
static int gate_words(PyObject *gate, Py_buffer *view) {
  if (!PyObject_GetBuffer(gate, view, PyBUF_WRITABLE | PyBUF_FORMAT)) {
    if (view->len == 3 * (Py_ssize_t)sizeof(int64_t) && view->itemsize == sizeof(int64_t) && view->format &&
        strcmp(view->format, "q") == 0)
      return 0;
    PyBuffer_Release(view);
  }
  PyErr_Clear();
  PyErr_Format(PyExc_TypeError, "a window's gate must be a writable array('q') of 3 words (ops.new_gate), got %R",
               gate);
  return -1;
}

/* ops.protect: an op of `gate` (None: of no request) reads what the ops `inputs` write; the request of each of
 * them from another gate is never skipped from now on, unless it was told to skip already. A gate is the array of
 * ops.new_gate: int64 words SKIP (0), DEADLINE (1), SHARED (2), as the core reads them. 0, or -1. */
static int protect(PyObject *inputs, PyObject *gate) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(inputs); i++) {
    PyObject *other = SLOT(PyList_GET_ITEM(inputs, i), S_GATE);
    if (other == Py_None || other == gate) continue;
    Py_buffer view;
    if (gate_words(other, &view)) return -1;
    int64_t *words = view.buf;
    if (!__atomic_load_n(&words[0], __ATOMIC_ACQUIRE)) __atomic_store_n(&words[2], 1, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
  }
  return 0;
}

/* ops.handed_over for `op`, held until this path handed it to `engine` (outside the engine's lock: a callback may
 * submit): what waited for its dispatch runs. Nothing can have where its `later` is still empty and no thread is
 * between its look at the op and its adding to `later` (under ops._later_lock): the GIL is held from this look on.
 * 0, or -1. */
static int handed_over(PyObject *engine, PyObject *op) {
  PyObject *later = SLOT(op, S_LATER);
  if (later == Py_None) return 0;
  if (PyTuple_CheckExact(later) && PyTuple_GET_SIZE(later) == 0) {
    PyObject *busy = PyObject_CallNoArgs(g_later_locked);
    if (!busy) return -1;
    Py_DECREF(busy);
    if (busy == Py_False) {
      set_slot(op, S_LATER, Py_None);
      return 0;
    }
  }
  PyObject *r = PyObject_CallFunctionObjArgs(g_handed_over, engine, op, NULL);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

/* Op.drop_unsubmitted for `op`, held for `engine`, whose submission fails with the error set (kept): what found it
 * meanwhile sees it failed. */
static void drop_unsubmitted(PyObject *op, PyObject *engine) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  PyObject *r = value ? PyObject_CallMethodObjArgs(op, s_drop_unsubmitted, engine, value, NULL) : NULL;
  if (!r && value) PyErr_WriteUnraisable(op);
  Py_XDECREF(r);
  PyErr_Restore(type, value, traceback);
}

/* BaseDevice._submit for the op of `body` (one command) bound for `engine`, through `window` (a Scheduler, or
 * None): the op, handed to its queue here or by dispatch_when_ready, or None (new reference) where Python must
 * take it. */
static PyObject *do_submit(PyObject *engine, PyObject *name, PyObject *body, PyObject *reads, PyObject *writes,
                           PyObject *keep, PyObject *result, PyObject *window) {
  if (Py_TYPE(engine) != g_native_type || !PyList_Check(body) || PyList_GET_SIZE(body) != 1 ||
      !PyTuple_Check(reads) || !PyTuple_Check(writes))
    Py_RETURN_NONE;
  ar_cmd work;
  int kind = work_record(PyList_GET_ITEM(body, 0), &work);
  if (kind <= 0) {
    if (kind < 0) return NULL;
    Py_RETURN_NONE;
  }
  int closed = engine_closed(engine);
  if (closed) { /* before the hazard logs learn of an op that would never run */
    if (closed < 0) return NULL;
    PyObject *r = PyObject_CallMethodOneArg(engine, s_check_open, name);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
  }
  PyObject *op = new_op(engine, name, keep, result);
  if (!op) return NULL;
  PyObject *deps = PyList_New(0), *inputs = PyList_New(0), *gate = Py_None;
  uint64_t gate_address = 0;
  if (!deps || !inputs) goto fail;
  if (window != Py_None) { /* the gate of its task's request, or the scheduler's own */
    gate = window_gate(window);
    if (!gate) goto fail;
    set_slot(op, S_GATE, gate);
    Py_DECREF(gate); /* the op holds it */
    Py_buffer view;
    if (gate_words(gate, &view)) goto fail;
    gate_address = (uint64_t)(uintptr_t)view.buf;
    PyBuffer_Release(&view);
  }
  /* its accesses and its place in the window at once (hazards.logs_held), in the order other threads' ops find
   * one another: none in a window then waits for one queued behind it */
  if (lock_take(g_logs_lock)) goto fail;
  int admitted = 1, logged = 0;
  for (Py_ssize_t i = 0; !logged && i < PyTuple_GET_SIZE(reads); i++)
    logged = log_access(PyTuple_GET_ITEM(reads, i), 0, 1, op, engine, deps, inputs);
  for (Py_ssize_t i = 0; !logged && i < PyTuple_GET_SIZE(writes); i++)
    logged = log_access(PyTuple_GET_ITEM(writes, i), 1, 0, op, engine, deps, inputs);
  if (!logged && window != Py_None && (admitted = window_admit(window, op)) < 0) logged = -1;
  if (lock_give(g_logs_lock, logged)) goto fail;
  Py_ssize_t ni = PyList_GET_SIZE(inputs);
  if (ni) {
    int same = PyList_GET_SIZE(deps) == ni; /* one list for both where they agree (a copy-out), as in Python */
    for (Py_ssize_t i = 0; same && i < ni; i++) same = PyList_GET_ITEM(deps, i) == PyList_GET_ITEM(inputs, i);
    set_slot(op, S_INPUTS, same ? deps : inputs);
    if (protect(inputs, gate)) goto fail;
  }
  int pushed = 0;
  if (admitted) {
    if (engine_take(engine, 0)) goto fail;
    pushed = engine_closed(engine);
    if (pushed == 0) pushed = push(engine, op, body, deps, window != Py_None, gate_address);
    else if (pushed == 1) pushed = PyList_GET_SIZE(deps) ? 0 : 2;
    if (engine_give(engine, 0, pushed) < 0) goto fail;
  }
  if (pushed == 2) { /* closed meanwhile, with no dependency: check_open raises, as push does */
    PyObject *r = PyObject_CallMethodOneArg(engine, s_check_open, name);
    Py_XDECREF(r);
    goto fail;
  }
  if (pushed == 0 && admitted && window != Py_None) { /* held: pended in the core, as _pend_held does */
    pushed = pend_held(engine, op, body, deps, gate_address);
    if (pushed < 0) goto fail;
  }
  if (pushed == 0) { /* dispatch_when_ready hands it on: held through a window, as the Python path does */
    if (PyList_GET_SIZE(deps)) set_slot(op, S_DEPS, deps);
    PyObject *r = PyObject_CallFunction(g_dispatch, "[(OOO)]OO", engine, body, op, window != Py_None ? Py_True : Py_False,
                                        admitted ? Py_None : window);
    if (!r) goto fail;
    Py_DECREF(r);
  } else if (op_value(op) != g_held && handed_over(engine, op)) { /* handed to its queue here */
    goto fail;
  }
  Py_DECREF(deps);
  Py_DECREF(inputs);
  return op;
fail:
  drop_unsubmitted(op, engine);
  Py_XDECREF(deps);
  Py_XDECREF(inputs);
  Py_DECREF(op);
  return NULL;
}

static PyObject *submit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "submit(engine, name, body, reads, writes, keep, result, window)");
    return NULL;
  }
  return do_submit(args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7]);
}

/* ---- the device's op methods: BaseDevice.launch, copyin and copyout for the common call ---------------- */

/* Whether `dev` takes ops on this path: open. 1, 0 (the Python path), -1. */
static int device_ready(PyObject *dev) {
  PyObject *state = ATTR(dev, s_state);
  if (!state) return -1;
  int open = state == s_open || (PyUnicode_Check(state) && PyUnicode_Compare(state, s_open) == 0);
  Py_DECREF(state);
  return open;
}

static int same(PyObject *a, PyObject *b) { /* a == b for str or int objects that the caller compares */
  if (a == b) return 1;
  int eq = PyObject_RichCompareBool(a, b, Py_EQ);
  if (eq < 0) PyErr_Clear();
  return eq > 0;
}

/* BaseDevice._check for a buffer of `dev` (named `devname`) on this path: 1 and its handle (new reference), or 0
 * where Python must look (not a Buffer, another device's, unallocated, freed, a view without its handle yet, a
 * closed owner: Python raises the error that fits or allocates the view's handle). -1 on error. */
static int buffer_handle(PyObject *dev, PyObject *devname, PyObject *buf, PyObject **handle) {
  *handle = NULL;
  if (Py_TYPE(buf) != g_buffer_type) return 0;
  PyObject *device = ATTR(buf, s_device), *base = NULL, *owner = NULL;
  int rc = -1;
  if (!device) return -1;
  if (!same(device, devname)) {
    rc = 0;
    goto out;
  }
  base = ATTR(buf, s_base);
  *handle = base ? ATTR(buf, s_handle) : NULL;
  if (!*handle) goto out;
  rc = 0;
  if (*handle == Py_None) goto out;
  PyObject *root = base == Py_None ? buf : base;
  if (root != buf) { /* a view: of the root's present allocation */
    PyObject *root_handle = ATTR(root, s_handle);
    PyObject *g = root_handle ? ATTR(buf, s_generation) : NULL;
    PyObject *rg = g ? ATTR(root, s_generation) : NULL;
    int ok = rg && root_handle != Py_None && same(g, rg);
    Py_XDECREF(rg);
    Py_XDECREF(g);
    Py_XDECREF(root_handle);
    if (PyErr_Occurred()) rc = -1;
    if (!ok) goto out;
  }
  owner = ATTR(root, s_owner);
  if (!owner) {
    rc = -1;
    goto out;
  }
  if (owner == dev || owner == Py_None) rc = 1;
out:
  if (rc != 1) Py_CLEAR(*handle);
  Py_XDECREF(owner);
  Py_XDECREF(base);
  Py_DECREF(device);
  return rc;
}

/* The kernel's packed arguments per its plan (a byte pair per parameter: kind p/f/i/u, bits), as
 * CPUProgram.bind packs them: 1 and a new bytes object, 0 where Python must check (a count or a value it would
 * refuse, a scalar that is not a plain int or float), -1 on error. */
static int pack_args(PyObject *kinds, PyObject *const *handles, Py_ssize_t nbufs, PyObject *vals, PyObject **out) {
  *out = NULL;
  Py_ssize_t nparams = PyBytes_GET_SIZE(kinds) / 2, bi = 0, vi = 0;
  Py_ssize_t nvals = PySequence_Fast_GET_SIZE(vals);
  PyObject **items = PySequence_Fast_ITEMS(vals);
  const unsigned char *plan = (const unsigned char *)PyBytes_AS_STRING(kinds);
  PyObject *bytes = PyBytes_FromStringAndSize(NULL, nparams * 8);
  if (!bytes) return -1;
  unsigned char *word = (unsigned char *)PyBytes_AS_STRING(bytes);
  for (Py_ssize_t i = 0; i < nparams; i++, word += 8) {
    int kind = plan[2 * i], bits = plan[2 * i + 1];
    if (kind == 'p') {
      if (bi == nbufs || !PyLong_CheckExact(handles[bi])) goto python;
      uint64_t address = as_u64(handles[bi++]);
      if (address == (uint64_t)-1 && PyErr_Occurred()) goto python;
      memcpy(word, &address, 8);
      continue;
    }
    if (vi == nvals) goto python;
    PyObject *val = items[vi++];
    if (PyFloat_CheckExact(val)) {
      if (kind != 'f') goto python;
      double d = PyFloat_AS_DOUBLE(val);
      memcpy(word, &d, 8);
      continue;
    }
    if (!PyLong_Check(val)) goto python; /* a numpy scalar, a wrong type: Python converts or refuses */
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(val, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) goto python; /* beyond int64: refused there */
    if (kind == 'f') {
      double d = (double)v;
      memcpy(word, &d, 8);
      continue;
    }
    if (kind == 'i' ? (bits < 64 && (v < -(1LL << (bits - 1)) || v >= (1LL << (bits - 1))))
                    : (v < 0 || (bits < 64 && v >= (1LL << bits))))
      goto python;
    memcpy(word, &v, 8);
  }
  if (bi != nbufs || vi != nvals) goto python;
  *out = bytes;
  return 1;
python:
  PyErr_Clear();
  Py_DECREF(bytes);
  return 0;
}

/* launch(dev, prog, bufs, vals, outs, hold, window, priority): BaseDevice.launch's op, or None for the Python path
 * (another queue or priority, a hold, `outs` given, a program without a plan, any check to make). */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "launch(dev, prog, bufs, vals, outs, hold, window, priority)");
    return NULL;
  }
  PyObject *dev = args[0], *prog = args[1], *bufs = args[2], *vals = args[3], *window = args[6];
  if (args[4] != Py_None || args[5] != Py_False || !is_zero(args[7]) || !PyTuple_CheckExact(bufs) ||
      !(PyTuple_CheckExact(vals) || PyList_CheckExact(vals)))
    Py_RETURN_NONE;
  int ready = device_ready(dev);
  if (ready <= 0) return ready < 0 ? NULL : Py_NewRef(Py_None);
  PyObject *owner = ATTR(prog, s_device), *plan = NULL, *devname = NULL, *engine = NULL;
  PyObject *outs = NULL, *reads = NULL, *writes = NULL, *body = NULL, *name = NULL, *packed = NULL, *result = NULL;
  PyObject *handles[16];
  Py_ssize_t nbufs = PyTuple_GET_SIZE(bufs), nh = 0;
  if (!owner) { /* not a program: Python says so */
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (owner != dev || nbufs > 16) goto python;
  plan = ATTR(prog, s_plan);
  if (!plan || !PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 2) goto python; /* (the bound callable, kinds or None) */
  PyObject *fn = PyTuple_GET_ITEM(plan, 0), *kinds = PyTuple_GET_ITEM(plan, 1);
  devname = ATTR(dev, s_name);
  engine = devname ? ATTR(dev, s_compute) : NULL;
  outs = engine ? ATTR(prog, s_outs) : NULL;
  name = outs ? ATTR(prog, s_name) : NULL;
  if (!name) goto error;
  for (; nh < nbufs; nh++) {
    int ok = buffer_handle(dev, devname, PyTuple_GET_ITEM(bufs, nh), &handles[nh]);
    if (ok <= 0) {
      if (ok < 0) goto error;
      goto python;
    }
  }
  /* the buffers it reads and those it writes: every one, or the read-only ones in order and `outs` sorted */
  if (outs == Py_None) {
    reads = PyTuple_New(0);
    writes = Py_NewRef(bufs);
  } else {
    if (!PyTuple_Check(outs)) goto python;
    uint32_t written = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(outs); i++) {
      long index = PyLong_AsLong(PyTuple_GET_ITEM(outs, i));
      if (index < 0 || index >= nbufs) goto python; /* out of range (or an error): Python's message */
      written |= 1u << index;
    }
    Py_ssize_t nw = __builtin_popcount(written);
    reads = PyTuple_New(nbufs - nw);
    writes = reads ? PyTuple_New(nw) : NULL;
    if (!writes) goto error;
    for (Py_ssize_t i = 0, r = 0, w = 0; i < nbufs; i++) {
      PyObject *buf = Py_NewRef(PyTuple_GET_ITEM(bufs, i));
      if (written & (1u << i)) PyTuple_SET_ITEM(writes, w++, buf);
      else PyTuple_SET_ITEM(reads, r++, buf);
    }
  }
  if (!reads || !writes) goto error;
  if (kinds == Py_None) { /* a program that takes any buffers and no scalars, and is called with no arguments */
    if (PySequence_Fast_GET_SIZE(vals)) goto python;
    body = one_command(tuple_of(4, PyLong_FromLong(C_EXEC), Py_NewRef(name), Py_NewRef(fn), PyTuple_New(0)));
  } else {
    if (!PyBytes_Check(kinds)) goto python;
    int ok = pack_args(kinds, handles, nbufs, vals, &packed);
    if (ok <= 0) {
      if (ok < 0) goto error;
      goto python;
    }
    PyObject *address = PyLong_FromVoidPtr(PyBytes_AS_STRING(packed));
    body = one_command(
        tuple_of(4, PyLong_FromLong(C_EXEC), Py_NewRef(name), Py_NewRef(fn), tuple_of(2, Py_NewRef(packed), address)));
  }
  if (!body) goto error;
  result = do_submit(engine, name, body, reads, writes, bufs, Py_None, window);
  goto out;
python:
  PyErr_Clear();
  result = Py_NewRef(Py_None);
  goto out;
error:
  result = NULL;
out:
  for (Py_ssize_t i = 0; i < nh; i++) Py_DECREF(handles[i]);
  Py_XDECREF(packed);
  Py_XDECREF(body);
  Py_XDECREF(writes);
  Py_XDECREF(reads);
  Py_XDECREF(name);
  Py_XDECREF(outs);
  Py_XDECREF(engine);
  Py_XDECREF(devname);
  Py_XDECREF(plan);
  Py_DECREF(owner);
  return result;
}

/* The memory of `data` for a copy, as aruntime.memory.pin holds it: 1 with (holder, address, nbytes), 0 where
 * pin must look (empty, not C-contiguous, read-only for a destination, a format that is not one plain number),
 * -1 on error. */
static int pin_plain(PyObject *data, int writable, PyObject **holder, uint64_t *address, Py_ssize_t *nbytes) {
  *holder = NULL;
  if (PyBytes_CheckExact(data) && !writable) {
    if (!PyBytes_GET_SIZE(data)) return 0;
    *holder = Py_NewRef(data);
    *address = (uint64_t)(uintptr_t)PyBytes_AS_STRING(data);
    *nbytes = PyBytes_GET_SIZE(data);
    return 1;
  }
  if (!PyObject_CheckBuffer(data)) return 0;
  PyObject *view = PyMemoryView_FromObject(data);
  if (!view) {
    PyErr_Clear();
    return 0;
  }
  Py_buffer *b = PyMemoryView_GET_BUFFER(view);
  const char *f = b->format ? b->format : "B";
  if (*f == '@' || *f == '=' || *f == '<' || *f == '>' || *f == '!') f++;
  int plain = f[0] && !f[1] && strchr("bBhHiIlLqQnNefdc?", f[0]);
  if (!plain || b->len <= 0 || (writable && b->readonly) || !PyBuffer_IsContiguous(b, 'C')) {
    Py_DECREF(view);
    return 0;
  }
  *holder = view;
  *address = (uint64_t)(uintptr_t)b->buf;
  *nbytes = b->len;
  return 1;
}

/* AccessLog.conflicts_on: whether an access to `buf` would wait for an unfinished op of `engine`. 1, 0, -1. */
static int conflicts_on(PyObject *buf, PyObject *engine, int write) {
  PyObject *log = ATTR(buf, s_log);
  PyObject *entries = log ? ATTR(log, s_entries) : NULL;
  PyObject *off = entries ? ATTR(buf, s_offset) : NULL;
  PyObject *size = off ? ATTR(buf, s_nbytes) : NULL;
  int rc = -1;
  if (!size) goto out;
  if (!PyList_Check(entries)) {
    PyErr_SetString(PyExc_TypeError, "a hazard log's entries must be a list");
    goto out;
  }
  long long start = PyLong_AsLongLong(off), end = start + PyLong_AsLongLong(size);
  if (PyErr_Occurred()) goto out;
  rc = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries) && !rc; i++) {
    PyObject *entry = PyList_GET_ITEM(entries, i);
    if (!is_entry(entry)) {
      rc = -1;
      break;
    }
    PyObject *other = PyTuple_GET_ITEM(entry, 3);
    long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0)), e = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
    if (PyErr_Occurred()) {
      rc = -1;
      break;
    }
    int w = PyTuple_GET_ITEM(entry, 2) == Py_True;
    if (SLOT(other, S_ENGINE) == engine && (write || w) && s < end && start < e) {
      int done = op_done(other);
      rc = done < 0 ? -1 : !done;
    }
  }
out:
  Py_XDECREF(size);
  Py_XDECREF(off);
  Py_XDECREF(entries);
  Py_XDECREF(log);
  return rc;
}

/* The name of a copy of `nbytes` ("copyin 64 B", "copyout 64 B"), a new reference: the last one made of each
 * direction is made again only for another size. */
static PyObject *copy_name(int out_copy, Py_ssize_t nbytes) {
  static PyObject *last[2];
  static Py_ssize_t last_size[2];
  if (!last[out_copy] || last_size[out_copy] != nbytes) {
    PyObject *name = PyUnicode_FromFormat(out_copy ? "copyout %zd B" : "copyin %zd B", nbytes);
    if (!name) return NULL;
    Py_XSETREF(last[out_copy], name);
    last_size[out_copy] = nbytes;
  }
  return Py_NewRef(last[out_copy]);
}

/* copy(dev, buf, data, into, hold, window, priority): BaseDevice.copyin's op (data given) or copyout's (data None:
 * into `into`, or a new result when it is None), or None for the Python path. */
static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "copy(dev, buf, host, out, hold, window, priority)");
    return NULL;
  }
  /* `host`: a copy-in's source, or a copy-out's destination (None: a new one); `out`: True for a copy-out */
  PyObject *dev = args[0], *buf = args[1], *data = args[2], *into = args[2], *window = args[5];
  int out_copy = args[3] == Py_True;
  if (args[4] != Py_False || !is_zero(args[6])) Py_RETURN_NONE;
  int ready = device_ready(dev);
  if (ready <= 0) return ready < 0 ? NULL : Py_NewRef(Py_None);
  PyObject *devname = ATTR(dev, s_name), *handle = NULL, *holder = NULL, *dest = NULL, *size = NULL;
  PyObject *engine = NULL, *name = NULL, *body = NULL, *fn = NULL, *result = NULL, *bufs = NULL, *keep = NULL;
  if (!devname) return NULL;
  int ok = buffer_handle(dev, devname, buf, &handle);
  if (ok <= 0) goto checked;
  size = ATTR(buf, s_nbytes);
  Py_ssize_t want = size ? PyLong_AsSsize_t(size) : -1;
  if (want < 0) { /* an error, or no size a buffer has: Python's */
    ok = 0;
    goto checked;
  }
  if (out_copy && into == Py_None) { /* typed(zeroed(nbytes), buf.dtype), as copyout makes it */
    PyObject *dtype = ATTR(buf, s_dtype);
    PyObject *fresh = dtype ? PyObject_CallOneArg(g_zeroed, size) : NULL;
    dest = fresh ? PyObject_CallFunctionObjArgs(g_typed, fresh, dtype, NULL) : NULL;
    Py_XDECREF(fresh);
    Py_XDECREF(dtype);
    if (!dest) {
      ok = -1;
      goto checked;
    }
  } else if (out_copy) {
    dest = Py_NewRef(into);
  }
  uint64_t address;
  Py_ssize_t nbytes;
  ok = pin_plain(out_copy ? dest : data, out_copy, &holder, &address, &nbytes);
  if (ok <= 0) goto checked;
  if (nbytes != want) { /* Python's error names both sizes */
    ok = 0;
    goto checked;
  }
  fn = PyObject_GetAttr(dev, s_copy_fn);
  PyObject *limit = fn ? ATTR(dev, s_inline) : NULL;
  long long inline_max = limit ? PyLong_AsLongLong(limit) : -1;
  Py_XDECREF(limit);
  if (inline_max == -1 && PyErr_Occurred()) {
    ok = -1;
    goto checked;
  }
  /* BaseDevice._copy_engine: a small copy that must wait for a kernel anyway runs after it on the compute queue */
  engine = ATTR(dev, s_compute);
  ok = engine ? 1 : -1;
  if (engine && nbytes <= inline_max) ok = conflicts_on(buf, engine, !out_copy) ? 1 : 2;
  else ok = 2;
  if (ok == 2) {
    Py_XSETREF(engine, ATTR(dev, s_copy));
    ok = engine ? 1 : -1;
  }
  if (PyErr_Occurred()) ok = -1;
  if (ok <= 0) goto checked;
  name = copy_name(out_copy, nbytes);
  if (!name) {
    ok = -1;
    goto checked;
  }
  PyObject *host = PyLong_FromUnsignedLongLong(address);
  body = one_command(tuple_of(6, PyLong_FromLong(C_COPY), Py_NewRef(name), Py_NewRef(fn),
                              out_copy ? host : Py_NewRef(handle), out_copy ? Py_NewRef(handle) : host,
                              PyLong_FromSsize_t(nbytes)));
  bufs = body ? PyTuple_Pack(1, buf) : NULL;
  keep = bufs ? PyTuple_Pack(2, holder, buf) : NULL;
  if (!keep) {
    ok = -1;
    goto checked;
  }
  PyObject *empty = PyTuple_New(0);
  if (empty) {
    result = out_copy ? do_submit(engine, name, body, bufs, empty, keep, dest, window)
                      : do_submit(engine, name, body, empty, bufs, keep, Py_None, window);
    Py_DECREF(empty);
  }
checked:
  if (ok == 0) {
    PyErr_Clear();
    result = Py_NewRef(Py_None);
  }
  Py_XDECREF(keep);
  Py_XDECREF(bufs);
  Py_XDECREF(body);
  Py_XDECREF(name);
  Py_XDECREF(engine);
  Py_XDECREF(fn);
  Py_XDECREF(holder);
  Py_XDECREF(dest);
  Py_XDECREF(size);
  Py_XDECREF(handle);
  Py_DECREF(devname);
  return result;
}

/* Scheduler._check_open where it passes (open, its queue not full) and the priority of a scheduled op (`given`, or
 * the scheduler's): 1 with `*priority` (new reference), 0 where Python must look (it raises, or a full queue
 * makes it retire first), -1. */
static int sched_ready(PyObject *sched, PyObject *given, PyObject **priority) {
  PyObject *open = ATTR(sched, s_sched_open), *queued = NULL, *limit = NULL;
  int rc = -1;
  *priority = NULL;
  if (!open) return -1;
  if (open != Py_True) {
    rc = 0;
    goto out;
  }
  queued = ATTR(sched, s_queued);
  limit = queued ? ATTR(sched, s_queue) : NULL;
  if (!limit) goto out;
  rc = 0;
  if (!PyLong_CheckExact(queued) || !PyLong_CheckExact(limit)) goto out;
  int below = PyObject_RichCompareBool(queued, limit, Py_LT);
  if (below <= 0) {
    rc = below;
    goto out;
  }
  *priority = given == Py_None ? ATTR(sched, s_priority) : Py_NewRef(given);
  rc = *priority ? 1 : -1;
out:
  Py_XDECREF(limit);
  Py_XDECREF(queued);
  Py_DECREF(open);
  return rc;
}

/* `submit_fn(self, call, n)` where `engine` (NULL where it could not be found) takes this path (its `fast` is set:
 * an engine opened with ARUNTIME_FAST_SUBMIT=0 has none), else None for the Python path, which says what is wrong. */
static PyObject *if_fast(PyObject *engine, PyObject *(*submit_fn)(PyObject *, PyObject *const *, Py_ssize_t),
                         PyObject *self, PyObject *const *call, Py_ssize_t n) {
  PyObject *fast = engine ? ATTR(engine, s_fast) : NULL;
  int yes = fast && fast != Py_None;
  Py_XDECREF(fast);
  if (yes) return submit_fn(self, call, n);
  PyErr_Clear();
  return Py_NewRef(Py_None);
}

/* sched_launch(sched, prog, bufs, vals, outs, priority): Scheduler.launch's op, or None for the Python path. */
static PyObject *sched_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "sched_launch(sched, prog, bufs, vals, outs, priority)");
    return NULL;
  }
  PyObject *priority;
  int ready = sched_ready(args[0], args[5], &priority);
  if (ready <= 0) return ready < 0 ? NULL : Py_NewRef(Py_None);
  PyObject *dev = ATTR(args[1], s_device); /* not a program: Python's; launch() checks it is one of this device */
  PyObject *engine = dev ? ATTR(dev, s_compute) : NULL;
  PyObject *call[8] = {dev, args[1], args[2], args[3], args[4], Py_False, args[0], priority};
  PyObject *result = if_fast(engine, launch, self, call, 8);
  Py_XDECREF(engine);
  Py_XDECREF(dev);
  Py_DECREF(priority);
  return result;
}

/* sched_copy(sched, buf, host, out, priority): Scheduler.copyin's op (`out` False, `host` its source) or copyout's
 * (`out` True, `host` its destination or None), or None for the Python path. */
static PyObject *sched_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "sched_copy(sched, buf, host, out, priority)");
    return NULL;
  }
  PyObject *priority, *result = NULL, *dev = NULL, *engine = NULL;
  int ready = sched_ready(args[0], args[4], &priority);
  if (ready <= 0) return ready < 0 ? NULL : Py_NewRef(Py_None);
  PyObject *buf = args[1], *base = Py_TYPE(buf) == g_buffer_type ? ATTR(buf, s_base) : NULL;
  if (base == Py_None) dev = ATTR(buf, s_owner); /* Buffer.owner of a root buffer whose device is open */
  if (dev && dev != Py_None) engine = ATTR(dev, s_copy); /* else a view or a device not opened yet: Python's */
  PyObject *call[7] = {dev, buf, args[2], args[3], Py_False, args[0], priority};
  result = if_fast(engine, copy, self, call, 7);
  Py_XDECREF(engine);
  Py_XDECREF(dev);
  Py_XDECREF(base);
  Py_DECREF(priority);
  return result;
}

static PyObject *state(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long signal, core, failures;
  PyObject *lock, *retire_lock, *inflight, *keeps, *python, *failed;
  if (!PyArg_ParseTuple(args, "KKKOOOOO!O!", &signal, &core, &failures, &lock, &retire_lock, &inflight, &keeps,
                        &PyDict_Type, &python, &PyDict_Type, &failed))
    return NULL;
  if (!signal || !core || !failures) {
    PyErr_SetString(PyExc_ValueError, "state: a native engine's addresses expected");
    return NULL;
  }
  engine_state *st = PyObject_New(engine_state, &state_type);
  if (!st) return NULL;
  for (int i = 0; i < STATE_OBJECTS; i++) state_objects(st)[i] = NULL;
  st->signal = (uint64_t *)(uintptr_t)signal;
  st->core = (void *)(uintptr_t)core;
  st->failures = (uint64_t *)(uintptr_t)failures;
  st->python = Py_NewRef(python);
  st->failed = Py_NewRef(failed);
  st->inflight = Py_NewRef(inflight);
  st->keeps = Py_NewRef(keeps);
  if (!Py_IS_TYPE(lock, &lock_type) || !Py_IS_TYPE(retire_lock, &lock_type)) {
    Py_DECREF(st);
    PyErr_SetString(PyExc_TypeError, "state: a native engine's locks must be this module's Lock (submit.new_lock)");
    return NULL;
  }
  st->lock = Py_NewRef(lock);
  st->retire_lock = Py_NewRef(retire_lock);
  st->append = PyObject_GetAttr(inflight, s_append);
  st->popleft = st->append ? PyObject_GetAttr(inflight, s_popleft) : NULL;
  st->keep_append = st->popleft ? PyObject_GetAttr(keeps, s_append) : NULL;
  st->keep_popleft = st->keep_append ? PyObject_GetAttr(keeps, s_popleft) : NULL;
  if (!st->keep_popleft) Py_CLEAR(st); /* lets go of what it got */
  return (PyObject *)st;
}

static PyObject *init(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *op_type, *native_type, *entry_type, *nothing, *native_copies, *op_ids, *wait_kind;
  PyObject *buffer_type, *recorder, *dispatch, *zeroed, *typed, *new_cells, *name_id, *record_deps_fn, *later_lock;
  PyObject *handed_over_fn, *logs_lock;
  unsigned long long submit_address, held, abandoned, pend_new, pend_on_sig, pend_on_pend, pend_go;
  Py_ssize_t cells;
  if (!PyArg_ParseTuple(args, "KKKKKKKnOOOOOOOOOOOOOOOOOO!", &submit_address, &pend_new, &pend_on_sig,
                        &pend_on_pend, &pend_go, &held, &abandoned, &cells, &op_type, &native_type, &entry_type,
                        &nothing, &native_copies, &op_ids, &wait_kind, &buffer_type, &recorder, &dispatch, &zeroed,
                        &typed, &new_cells, &name_id, &record_deps_fn, &later_lock, &handed_over_fn, &lock_type,
                        &logs_lock))
    return NULL;
  if (!PyCallable_Check(name_id) || !PyCallable_Check(record_deps_fn) || !PyCallable_Check(handed_over_fn)) {
    PyErr_SetString(PyExc_TypeError,
                    "init: the profile's name numbering and flow recording functions, and handed_over expected");
    return NULL;
  }
  g_later_acquire = PyObject_GetAttr(later_lock, s_acquire);
  g_later_release = g_later_acquire ? PyObject_GetAttr(later_lock, s_release) : NULL;
  g_later_locked = g_later_release ? PyObject_GetAttr(later_lock, s_locked) : NULL;
  g_held_value = g_later_locked ? PyLong_FromUnsignedLongLong(held) : NULL;
  if (!g_held_value) return NULL;
  g_handed_over = Py_NewRef(handed_over_fn);
  g_logs_lock = Py_NewRef(logs_lock);
  g_name_id = Py_NewRef(name_id);
  g_record_deps = Py_NewRef(record_deps_fn);
  if (!pend_new || !pend_on_sig || !pend_on_pend || !pend_go || cells < 1 || !PyCallable_Check(new_cells)) {
    PyErr_SetString(PyExc_TypeError, "init: the core's pending-op functions, a cell count and a cell maker expected");
    return NULL;
  }
  g_pend_new = (pend_new_fn)(uintptr_t)pend_new;
  g_pend_on_sig = (pend_on_sig_fn)(uintptr_t)pend_on_sig;
  g_pend_on_pend = (pend_on_pend_fn)(uintptr_t)pend_on_pend;
  g_pend_go = (pend_go_fn)(uintptr_t)pend_go;
  g_cells = cells;
  g_new_cells = Py_NewRef(new_cells);
  if (!PyType_Check(op_type) || !PyType_Check(native_type) || !PyType_Check(entry_type) || !PyDict_Check(nothing) ||
      !PyDict_Check(native_copies) || !PyType_Check(buffer_type) || !submit_address) {
    PyErr_SetString(PyExc_TypeError, "init: types, dicts and the address of ar_submit expected");
    return NULL;
  }
  if (slot_offsets(op_type, slot_names, g_off, N_SLOTS)) return NULL;
  g_submit = (submit_fn)(uintptr_t)submit_address;
  g_held = held;
  g_abandoned = abandoned;
  g_op_type = (PyTypeObject *)Py_NewRef(op_type);
  g_native_type = (PyTypeObject *)Py_NewRef(native_type);
  g_entry_type = (PyTypeObject *)Py_NewRef(entry_type);
  g_nothing = Py_NewRef(nothing);
  g_native_copies = Py_NewRef(native_copies);
  g_op_ids = Py_NewRef(op_ids);
  g_wait_kind = Py_NewRef(wait_kind);
  g_buffer_type = (PyTypeObject *)Py_NewRef(buffer_type);
  g_recorder = Py_NewRef(recorder);
  g_dispatch = Py_NewRef(dispatch);
  g_zeroed = Py_NewRef(zeroed);
  g_typed = Py_NewRef(typed);
  Py_RETURN_NONE;
}

/* accesses(buffers, accesses, ops, deps, inputs), under hazards.logs_held: for each (engine, index, writes,
 * consumes) of `accesses`,
 * AccessLog.access of all of buffers[index] by ops[engine], bound for engine, adding to deps[engine] and
 * inputs[engine] (dicts of lists), as a graph replay records its accesses; None. */
static int record_accesses(PyObject *bufs, PyObject *list, PyObject *ops, PyObject *all_deps, PyObject *all_inputs);

static PyObject *accesses(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[2]) ||
      !PyDict_Check(args[3]) || !PyDict_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "accesses(list of buffers, list of accesses, ops, deps, inputs: dicts)");
    return NULL;
  }
  if (record_accesses(args[0], args[1], args[2], args[3], args[4])) return NULL;
  Py_RETURN_NONE;
}

/* accesses' loop: 0, or -1. */
static int record_accesses(PyObject *bufs, PyObject *list, PyObject *ops, PyObject *all_deps, PyObject *all_inputs) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
    PyObject *a = PyList_GET_ITEM(list, i);
    if (!PyTuple_Check(a) || PyTuple_GET_SIZE(a) != 4) {
      PyErr_Format(PyExc_TypeError, "accesses: %R is not (engine, index, writes, consumes)", a);
      return -1;
    }
    PyObject *engine = PyTuple_GET_ITEM(a, 0);
    Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(a, 1));
    if (index == -1 && PyErr_Occurred()) return -1;
    if (index < 0 || index >= PyList_GET_SIZE(bufs)) {
      PyErr_Format(PyExc_IndexError, "accesses: buffer index %zd of %zd", index, PyList_GET_SIZE(bufs));
      return -1;
    }
    int write = PyObject_IsTrue(PyTuple_GET_ITEM(a, 2)), consumes = PyObject_IsTrue(PyTuple_GET_ITEM(a, 3));
    if (write < 0 || consumes < 0) return -1;
    PyObject *op = PyDict_GetItemWithError(ops, engine);
    PyObject *deps = op ? PyDict_GetItemWithError(all_deps, engine) : NULL;
    PyObject *inputs = deps ? PyDict_GetItemWithError(all_inputs, engine) : NULL;
    if (!inputs) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "accesses: no op, deps or inputs for %R", engine);
      return -1;
    }
    if (!is_op(op, "accesses' ops") || !PyList_Check(deps) || !PyList_Check(inputs)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "accesses: deps and inputs must hold lists");
      return -1;
    }
    if (log_access(PyList_GET_ITEM(bufs, index), write, consumes, op, engine, deps, inputs)) return -1;
  }
  return 0;
}

/* One hole of put_copies (see there) put into `body`, patching `recs` (`nrecs` records, or none): 1, 0 where the
 * Python path must take it, -1 on error. */
static int put_copy(PyObject *body, PyObject *hole, PyObject *inputs, PyObject *keep, PyObject *results, ar_cmd *recs,
                    Py_ssize_t nrecs, PyObject **dev, PyObject **dev_fn) {
  if (!PyTuple_Check(hole) || PyTuple_GET_SIZE(hole) != 7) {
    PyErr_Format(PyExc_TypeError, "put_copies: hole %R is not (at, out, host, nbytes, handle, device, name)", hole);
    return -1;
  }
  Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(hole, 0));
  int out = PyTuple_GET_ITEM(hole, 1) == Py_True;
  PyObject *host = PyTuple_GET_ITEM(hole, 2), *size = PyTuple_GET_ITEM(hole, 3), *handle = PyTuple_GET_ITEM(hole, 4);
  Py_ssize_t want = PyLong_AsSsize_t(size);
  if (want == -1 && PyErr_Occurred()) return -1;
  uint64_t h = as_u64(handle);
  if (h == (uint64_t)-1 && PyErr_Occurred()) return -1;
  if (at < 0 || at >= PyList_GET_SIZE(body)) return 0;
  PyObject *old = PyList_GET_ITEM(body, at);
  PyObject *data = PyDict_GetItemWithError(inputs, host); /* borrowed: the dict holds it */
  if (!data) return PyErr_Occurred() ? -1 : 0;
  PyObject *fn; /* the device's copy function, now: looked up once per device and call */
  if (PyTuple_GET_ITEM(hole, 5) == *dev) {
    fn = Py_NewRef(*dev_fn);
  } else {
    fn = PyObject_GetAttr(PyTuple_GET_ITEM(hole, 5), s_copy_fn);
    if (!fn) return -1;
    Py_XSETREF(*dev_fn, Py_NewRef(fn));
    *dev = PyTuple_GET_ITEM(hole, 5); /* the holes hold it */
  }
  PyObject *holder = NULL, *cmd = NULL;
  uint64_t address;
  Py_ssize_t nbytes;
  int rc = 0;
  if (!PyTuple_Check(old) || PyTuple_GET_SIZE(old) != 6 || PyTuple_GET_ITEM(old, 2) != fn) goto out;
  rc = pin_plain(data, out, &holder, &address, &nbytes);
  if (rc <= 0 || nbytes != want) {
    rc = rc < 0 ? -1 : 0;
    goto out;
  }
  rc = -1;
  PyObject *at_host = PyLong_FromUnsignedLongLong(address);
  cmd = at_host ? PyTuple_New(6) : NULL;
  if (!cmd) {
    Py_XDECREF(at_host);
    goto out;
  }
  PyObject *items[6] = {PyTuple_GET_ITEM(old, 0), PyTuple_GET_ITEM(hole, 6), fn, out ? at_host : handle,
                        out ? handle : at_host, size}; /* (COPY, name, fn, dst, src, nbytes) */
  for (int k = 0; k < 6; k++) PyTuple_SET_ITEM(cmd, k, k == 3 || k == 4 ? items[k] : Py_NewRef(items[k]));
  Py_INCREF(handle); /* at_host's reference passes to the tuple */
  if (PyList_Append(keep, holder) || (out && PyDict_SetItem(results, host, data))) goto out;
  PyList_SetItem(body, at, cmd); /* takes cmd, drops old */
  cmd = NULL;
  ar_cmd *rec = at < nrecs ? recs + at : NULL;
  if (rec && rec->kind == K_COPY) { /* a copy the worker runs as a memmove (a NOP on a device without memory) */
    rec->a = out ? address : h;
    rec->b = out ? h : address;
    rec->c = (uint64_t)want;
  }
  rc = 1;
out:
  Py_XDECREF(cmd);
  Py_XDECREF(holder);
  Py_DECREF(fn);
  return rc;
}

/* put_copies(body, holes, start, inputs, keep, results): a graph replay's host copies into `body` (a Prepared
 * list; a native one's packed records, its `words`, are patched too), as Graph._command and Prepared.put make
 * them: for each hole from `start`, (position, is a copy-out, host name, nbytes, buffer handle, device, name),
 * the host memory inputs[name] pinned (its holder added to `keep`; a copy-out's also set in results[name]) and
 * the copy command put at its position. Stops at the first hole it cannot take as it stands (a destination not
 * given, memory pin must look at, a size that differs, a copy function other than the one there): returns its
 * index (len(holes) once all are put), for the Python path to take it. */
static PyObject *put_copies(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 6 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[3]) ||
      !PyList_Check(args[4]) || !PyDict_Check(args[5])) {
    PyErr_SetString(PyExc_TypeError, "put_copies(body: list, holes: list, start, inputs: dict, keep: list, results: dict)");
    return NULL;
  }
  PyObject *body = args[0], *holes = args[1];
  Py_ssize_t i = PyLong_AsSsize_t(args[2]);
  if (i == -1 && PyErr_Occurred()) return NULL;
  PyObject *words_obj = PyObject_GetAttrString(body, "words"); /* a native engine's Prepared has them */
  if (!words_obj) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
    PyErr_Clear();
  }
  Py_buffer words = {0};
  if (words_obj && words_obj != Py_None && PyObject_GetBuffer(words_obj, &words, PyBUF_WRITABLE)) {
    Py_DECREF(words_obj);
    return NULL;
  }
  Py_ssize_t nrecs = words.buf ? words.len / (Py_ssize_t)sizeof(ar_cmd) : 0;
  int rc = 1;
  PyObject *dev = NULL, *dev_fn = NULL;
  for (i = i < 0 ? 0 : i; i < PyList_GET_SIZE(holes); i++) {
    rc = put_copy(body, PyList_GET_ITEM(holes, i), args[3], args[4], args[5], words.buf, nrecs, &dev, &dev_fn);
    if (rc <= 0) break;
  }
  Py_XDECREF(dev_fn);
  if (words.buf) PyBuffer_Release(&words);
  Py_XDECREF(words_obj);
  return rc < 0 ? NULL : PyLong_FromSsize_t(i);
}

/* ---- DLPack ------------------------------------------------------------------------------------------ */

static PyObject *g_capsule_delete; /* aruntime.memory.dlpack's end of an exported tensor, given its address */

/* The destructor of an exported DLPack capsule: one that no consumer took (a consumer renames it) ends its
 * tensor's loan. A consumer that refused the capsule frees it with its own error pending, which no Python code may
 * run under: the error is set aside around the call and put back. */
static void capsule_gone(PyObject *capsule) {
  static const char *const names[] = {"dltensor", "dltensor_versioned"};
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  for (int i = 0; i < 2 && g_capsule_delete; i++) {
    if (!PyCapsule_IsValid(capsule, names[i])) continue; /* never fails */
    PyObject *address = PyLong_FromVoidPtr(PyCapsule_GetPointer(capsule, names[i]));
    PyObject *r = address ? PyObject_CallOneArg(g_capsule_delete, address) : NULL;
    if (!r) PyErr_WriteUnraisable(g_capsule_delete);
    Py_XDECREF(r);
    Py_XDECREF(address);
  }
  PyErr_Restore(type, value, traceback);
}

/* capsule_destructor(delete): the address of capsule_gone, which calls `delete(address of the managed tensor)`. */
static PyObject *capsule_destructor(PyObject *self, PyObject *delete) {
  (void)self;
  if (!PyCallable_Check(delete)) {
    PyErr_Format(PyExc_TypeError, "capsule_destructor: a callable expected, got %R", delete);
    return NULL;
  }
  Py_XSETREF(g_capsule_delete, Py_NewRef(delete));
  return PyLong_FromVoidPtr((void *)capsule_gone);
}

/* held_here(): whether the calling thread holds a Lock of this module (taken and let go of on one thread). */
static PyObject *held_here(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyBool_FromLong(t_held > 0);
}

static PyMethodDef methods[] = {
    {"held_here", held_here, METH_NOARGS, "held_here(): whether the calling thread holds a Lock of this module"},
    {"put_copies", (PyCFunction)(void (*)(void))put_copies, METH_FASTCALL,
     "put_copies(body, holes, start, inputs, keep, results): a graph replay's host copies put, up to the index returned"},
    {"accesses", (PyCFunction)(void (*)(void))accesses, METH_FASTCALL,
     "accesses(buffers, accesses, ops, deps, inputs): a graph replay's accesses recorded in the hazard logs"},
    {"submit", (PyCFunction)(void (*)(void))submit, METH_FASTCALL,
     "submit(engine, name, body, reads, writes, keep, result, window): the op, or None for the Python path"},
    {"retire", retire, METH_O, "retire(engine): NativeEngine.retire's work, True, or None for the Python path"},
    {"retire_window", (PyCFunction)(void (*)(void))retire_window, METH_FASTCALL,
     "retire_window(inflight, failed): Scheduler._retire's work on its window and failure list"},
    {"enqueue", (PyCFunction)(void (*)(void))enqueue, METH_FASTCALL,
     "enqueue(engine, cmds, op): NativeEngine._enqueue's work, True, or None for the Python path"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(dev, prog, bufs, vals, outs, hold, window, priority): the op, or None for the Python path"},
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dev, buf, host, out, hold, window, priority): a copy-in's or (out) copy-out's op, or None"},
    {"sched_launch", (PyCFunction)(void (*)(void))sched_launch, METH_FASTCALL,
     "sched_launch(sched, prog, bufs, vals, outs, priority): Scheduler.launch's op, or None for the Python path"},
    {"sched_copy", (PyCFunction)(void (*)(void))sched_copy, METH_FASTCALL,
     "sched_copy(sched, buf, host, out, priority): Scheduler.copyin's or (out) copyout's op, or None"},
    {"capsule_destructor", capsule_destructor, METH_O,
     "capsule_destructor(delete): the address of a DLPack capsule destructor that calls delete(tensor address)"},
    {"state", state, METH_VARARGS,
     "state(signal address, core engine address, failures address, lock, retire lock, in-flight deque, its keep "
     "deque, python ops dict, failures dict): a native engine's `_fast_state`"},
    {"init", init, METH_VARARGS,
     "init(the addresses of ar_submit, ar_pend_new, ar_pend_on_sig, ar_pend_on_pend and ar_pend_go, HELD, ABANDONED, "
     "CELLS, Op, NativeEngine, Entry, nothing, copies, ids, WAIT, Buffer, recorder, "
     "dispatch_when_ready, zeroed, typed, new_cells, name_id, record_deps, the ops' lock)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_submit", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__submit(void) {
  struct {
    PyObject **where;
    const char *text;
  } names[] = {
      {&s_log, "_log"},          {&s_offset, "_offset"},     {&s_nbytes, "_nbytes"},     {&s_entries, "entries"},
      {&s_signal, "signal"},    {&s_ptr, "ptr"},           {&s_timeout, "timeout"},   {&s_closed, "closed"},
      {&s_lock, "_lock"},       {&s_inflight, "_inflight"}, {&s_done, "done"},
      {&s_dispatched, "dispatched"}, {&s_address, "_address"}, {&s_python, "_python"}, {&s_thread, "_thread"},
      {&s_python_runs, "_python_runs"}, {&s_check_open, "check_open"}, {&s_acquire, "acquire"},
      {&s_release, "release"},  {&s_append, "append"},
      {&s_failures_seen, "failures_seen"}, {&s_failed, "_failed"},
      {&s_state, "state"},      {&s_open, "open"},         {&s_enabled, "enabled"},   {&s_device, "_device"},
      {&s_plan, "_plan"},       {&s_outs, "_outs"},         {&s_name, "name"},         {&s_compute, "_compute"},
      {&s_copy, "_copy"},        {&s_base, "_base"},        {&s_handle, "_handle"},    {&s_generation, "_generation"},
      {&s_owner, "_owner"},     {&s_dtype, "_dtype"},       {&s_copy_fn, "copy_fn"},   {&s_inline, "_inline_copy_max"},
      {&s_fast_state, "_fast_state"}, {&s_retire_lock, "_retire_lock"}, {&s_popleft, "popleft"},
      {&s_gate, "_gate"},       {&s_admit, "_admit"},
      {&s_pended, "_pended"},   {&s_pended_keep, "_pended_keep"}, {&s_pended_at, "_pended_at"},
      {&s_retire_python, "_retire"}, {&s_cell_at, "_cell_at"}, {&s_cells, "_cells"}, {&s_cells_pin, "_cells_pin"}, {&s_held, "held"},
      {&s_request_var, "_request_var"}, {&s_own_gate, "_own_gate"}, {&s_waiting, "_waiting"}, {&s_window, "_window"},
      {&s_sched_open, "_open"}, {&s_queued, "_queued"}, {&s_queue, "_queue"}, {&s_priority, "priority"},
      {&s_fast, "fast"},        {&s_locked, "locked"},     {&s_drop_unsubmitted, "drop_unsubmitted"},
      {&s_resolve_when_handed_on, "resolve_when_handed_on"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    *names[i].where = PyUnicode_InternFromString(names[i].text);
    if (!*names[i].where) return NULL;
  }
  if (PyType_Ready(&state_type) < 0 || PyType_Ready(&lock_type) < 0) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m && PyModule_AddObjectRef(m, "Lock", (PyObject *)&lock_type) < 0) Py_CLEAR(m);
  return m;
}
