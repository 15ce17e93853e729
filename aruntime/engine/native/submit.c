/* The eager submission path of the native engine, as a CPython extension module (`submit`).
 *
 * submit(engine, name, body, reads, writes, keep, result) does what BaseDevice._submit, AccessLog.access,
 * dispatch_when_ready and NativeEngine.push do in Python for the common op: one kernel or copy the worker runs
 * without Python, submitted with no window, no hold and no profile recording. It makes the Op, records its
 * accesses in the buffers' hazard logs, and appends its records (a wait per other queue it depends on, a
 * dependency check when an input is unfinished, the work) to the engine's ring through the core's ar_submit.
 *
 * Returns None before any side effect where the op is not such an op (the caller takes the Python path), and
 * the Op otherwise. An Op whose `engine` is still None has had its accesses recorded (its `deps` and `inputs`
 * set) but could not be handed on here (a dependency not yet handed to its queue, one on a queue of another
 * kind, a closed engine): the caller hands it on with dispatch_when_ready. Every rule is the Python one; the
 * Python code stays the reference and the fallback where this module cannot be built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
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

enum { K_WAIT = 0, K_COPY = 3, K_EXEC = 4, K_NOP = 5, K_CHECK = 6 };
enum { C_WAIT = 0, C_EXEC = 3, C_COPY = 4 }; /* command kinds of the Python side (ops.py) */
#define F_END 1u
#define CHECK_BIT (1u << 31)
#define MAX_WAITS 8
#define MAX_RECORDS (MAX_WAITS + 2)
#define RETIRE_EVERY 64

static submit_fn g_submit;
static uint64_t g_held;
static PyTypeObject *g_op_type, *g_native_type, *g_entry_type;
static PyObject *g_nothing, *g_native_copies, *g_op_ids, *g_protect, *g_wait_kind;

/* offsets of the Op's slots */
enum { S_CELL, S_CMDS, S_DEPS, S_ENGINE, S_ERROR, S_GATE, S_ID, S_INPUTS, S_KEEP, S_LATER, S_NAME, S_OBSERVED,
       S_PEND, S_RESULT, S_VALUE, N_SLOTS };
static const char *slot_names[N_SLOTS] = {"cell", "cmds", "deps", "engine", "error", "gate", "id", "inputs",
                                          "keep", "later", "name", "observed", "pend", "result", "value"};
static Py_ssize_t g_off[N_SLOTS];

#define SLOT(op, s) (*(PyObject **)((char *)(op) + g_off[s]))

static void set_slot(PyObject *op, int s, PyObject *value) {
  PyObject *old = SLOT(op, s);
  Py_INCREF(value);
  SLOT(op, s) = value;
  Py_XDECREF(old);
}

static PyObject *s_log, *s_offset, *s_nbytes, *s_entries, *s_signal, *s_ptr, *s_timeout, *s_closed, *s_lock,
    *s_inflight, *s_retire, *s_done, *s_dispatched, *s_address, *s_python, *s_thread, *s_python_runs,
    *s_check_open, *s_acquire, *s_release, *s_append, *s_failures, *s_failures_seen, *s_failed;

/* ---- ops --------------------------------------------------------------------------------------------- */

static uint64_t op_value(PyObject *op) { /* its value slot, an int below 2**64 */
  PyObject *v = SLOT(op, S_VALUE);
  return v ? PyLong_AsUnsignedLongLong(v) : 0;
}

/* The native signal value of a native engine (its signal's ptr), or -1 with no error set for another engine. */
static int signal_value(PyObject *engine, uint64_t *out) {
  if (Py_TYPE(engine) != g_native_type) return -1;
  PyObject *sig = PyObject_GetAttr(engine, s_signal);
  if (!sig) return -2;
  PyObject *ptr = PyObject_GetAttr(sig, s_ptr);
  Py_DECREF(sig);
  if (!ptr) return -2;
  uint64_t *p = (uint64_t *)PyLong_AsVoidPtr(ptr);
  Py_DECREF(ptr);
  if (!p) return PyErr_Occurred() ? -2 : -1;
  *out = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  return 0;
}

/* Whether native `engine` has no failure that Python has not set on its op yet (NativeEngine.retire): the core
 * logs a failure before the op's value is reached, so a reached op of such an engine did not fail. 1, 0, -1. */
static int failures_settled(PyObject *engine) {
  PyObject *failures = PyObject_GetAttr(engine, s_failures), *seen = NULL, *failed = NULL;
  int rc = -1;
  if (!failures || !PyMemoryView_Check(failures)) goto out;
  uint64_t count = __atomic_load_n((uint64_t *)PyMemoryView_GET_BUFFER(failures)->buf, __ATOMIC_ACQUIRE);
  seen = PyObject_GetAttr(engine, s_failures_seen);
  failed = seen ? PyObject_GetAttr(engine, s_failed) : NULL;
  if (!failed) goto out;
  unsigned long long n = PyLong_AsUnsignedLongLong(seen);
  if (PyErr_Occurred()) goto out;
  rc = n == count && PyDict_Check(failed) && PyDict_GET_SIZE(failed) == 0;
out:
  if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a native engine's failure log is unreadable");
  Py_XDECREF(failed);
  Py_XDECREF(seen);
  Py_XDECREF(failures);
  return rc;
}

/* Op.done(): 1, 0, or -1 on error. A retired op of a native engine is read here; anything else asks Op.done. */
static int op_done(PyObject *op) {
  PyObject *engine = SLOT(op, S_ENGINE);
  if (engine == Py_None) return 0;
  uint64_t value = op_value(op);
  if (value == (uint64_t)-1 && PyErr_Occurred()) return -1;
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

static int contains(PyObject *list, PyObject *item) {
  Py_ssize_t n = PyList_GET_SIZE(list);
  for (Py_ssize_t i = 0; i < n; i++)
    if (PyList_GET_ITEM(list, i) == item) return 1;
  return 0;
}

/* AccessLog.access (memory/hazards.py), the same rules: -1 on error. */
static int log_access(PyObject *buf, int write, PyObject *op, PyObject *engine, PyObject *deps, PyObject *inputs) {
  int consumes = !write;
  PyObject *log = PyObject_GetAttr(buf, s_log);
  if (!log) return -1;
  PyObject *off = PyObject_GetAttr(buf, s_offset), *size = off ? PyObject_GetAttr(buf, s_nbytes) : NULL;
  PyObject *entries = size ? PyObject_GetAttr(log, s_entries) : NULL;
  PyObject *live = NULL, *end_obj = NULL, *mine = NULL;
  int rc = -1;
  if (!entries) goto out;
  if (!PyList_Check(entries)) {
    PyErr_SetString(PyExc_TypeError, "a hazard log's entries must be a list");
    goto out;
  }
  long long start = PyLong_AsLongLong(off), end = start + PyLong_AsLongLong(size);
  if (PyErr_Occurred()) goto out;
  live = PyList_New(0);
  if (!live) goto out;
  Py_ssize_t n = PyList_GET_SIZE(entries);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *entry = PyList_GET_ITEM(entries, i);
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
    if (covered && !write) {
      covered = 0;
      if (!w && SLOT(other, S_ENGINE) == engine) {
        PyObject *d = PyObject_GetAttr(other, s_dispatched);
        if (!d) goto out;
        covered = PyObject_IsTrue(d);
        Py_DECREF(d);
        if (covered < 0) goto out;
      }
    }
    if (!covered && PyList_Append(live, entry)) goto out;
  }
  end_obj = PyLong_FromLongLong(end);
  mine = end_obj ? PyTuple_Pack(4, off, end_obj, write ? Py_True : Py_False, op) : NULL;
  if (!mine || PyList_Append(live, mine) || PyObject_SetAttr(log, s_entries, live)) goto out;
  rc = 0;
out:
  Py_XDECREF(mine);
  Py_XDECREF(end_obj);
  Py_XDECREF(live);
  Py_XDECREF(entries);
  Py_XDECREF(size);
  Py_XDECREF(off);
  Py_DECREF(log);
  return rc;
}

/* A new Op(name, (), keep, result), as Op.__init__ makes it. */
static PyObject *new_op(PyObject *name, PyObject *keep, PyObject *result) {
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
  set_slot(op, S_ENGINE, Py_None);
  set_slot(op, S_CMDS, Py_None);
  set_slot(op, S_VALUE, zero);
  set_slot(op, S_LATER, Py_None);
  set_slot(op, S_CELL, Py_None);
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
  PyObject *key = PyLong_FromVoidPtr(fn);
  if (!key) return -1;
  int nothing = PyDict_Contains(g_nothing, key), native = nothing == 0 ? PyDict_Contains(g_native_copies, key) : 0;
  Py_DECREF(key);
  if (nothing < 0 || native < 0) return -1;
  memset(rec, 0, sizeof *rec);
  if (kind == C_EXEC && Py_TYPE(fn) == g_entry_type) {
    PyObject *args = PyTuple_GET_ITEM(cmd, 3);
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 2) return 0;
    PyObject *address = PyObject_GetAttr(fn, s_address);
    if (!address) return -1;
    rec->kind = K_EXEC;
    rec->a = PyLong_AsUnsignedLongLong(address);
    rec->b = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, 1));
    Py_DECREF(address);
  } else if (nothing) {
    rec->kind = K_NOP;
  } else if (kind == C_COPY && native && PyTuple_GET_SIZE(cmd) == 6) {
    rec->kind = K_COPY;
    rec->a = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(cmd, 3));
    rec->b = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(cmd, 4));
    rec->c = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(cmd, 5));
  } else {
    return 0;
  }
  return PyErr_Occurred() ? -1 : 1;
}

static PyObject *engine_signal_ptr(PyObject *engine, PyObject **sig_out) {
  PyObject *sig = PyObject_GetAttr(engine, s_signal);
  if (!sig) return NULL;
  PyObject *ptr = PyObject_GetAttr(sig, s_ptr);
  if (!ptr) {
    Py_DECREF(sig);
    return NULL;
  }
  *sig_out = sig;
  return ptr;
}

typedef struct {
  PyObject *engine; /* borrowed: a dep's, alive while the dep is */
  uint64_t value;
} wait_t;

/* Hand `op` (deps and inputs recorded) to native `engine` with the wait and check records it needs.
 * 1: handed on; 0: not here (the caller finishes in Python); -1: error. Under the engine's lock. */
static int push(PyObject *engine, PyObject *op, PyObject *body, ar_cmd *work, PyObject *deps, PyObject *inputs) {
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
    if (Py_TYPE(dep_engine) != g_native_type) return 0;
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
  /* the dependency check: (engine address, value) per unfinished input, (0, 0) where Python must look */
  PyObject *pairs = NULL;
  Py_ssize_t ni = PyList_GET_SIZE(inputs);
  if (ni) {
    uint64_t buf[2 * 16];
    Py_ssize_t np = 0;
    if (ni > 16) return 0;
    for (Py_ssize_t i = 0; i < ni; i++) {
      PyObject *dep = PyList_GET_ITEM(inputs, i);
      int done = op_done(dep);
      if (done < 0) return -1;
      uint64_t address = 0, value = 0;
      if (done) {
        if (SLOT(dep, S_ERROR) == Py_None) continue;
      } else if (Py_TYPE(SLOT(dep, S_ENGINE)) == g_native_type) {
        value = op_value(dep);
        if (value == g_held) return 0; /* its value is in a cell: the Python path */
        PyObject *a = PyObject_GetAttr(SLOT(dep, S_ENGINE), s_address);
        if (!a) return -1;
        address = PyLong_AsUnsignedLongLong(a);
        Py_DECREF(a);
        if (PyErr_Occurred()) return -1;
      }
      buf[np++] = address;
      buf[np++] = value;
    }
    if (np) {
      pairs = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)(np * sizeof(uint64_t)));
      if (!pairs) return -1;
    }
  }
  ar_cmd recs[MAX_RECORDS];
  PyObject *cmds = PyList_New(0), *keep = Py_None, *ptr = NULL, *sig = NULL, *item = NULL;
  int n = 0, rc = -1;
  if (!cmds) goto out;
  PyObject *op_id = SLOT(op, S_ID);
  uint64_t id = PyLong_AsUnsignedLongLong(op_id);
  for (int i = 0; i < nwaits; i++) {
    ptr = engine_signal_ptr(waits[i].engine, &sig);
    if (!ptr) goto out;
    PyObject *timeout = PyObject_GetAttr(sig, s_timeout);
    if (!timeout) goto out;
    double seconds = PyFloat_AsDouble(timeout);
    Py_DECREF(timeout);
    memset(&recs[n], 0, sizeof recs[n]);
    recs[n].kind = K_WAIT;
    recs[n].a = PyLong_AsUnsignedLongLong(ptr);
    recs[n].b = waits[i].value;
    recs[n].c = (uint64_t)(int64_t)(seconds * 1e9);
    recs[n].op = id;
    recs[n].index = (uint32_t)i;
    n++;
    item = Py_BuildValue("(OOK)", g_wait_kind, sig, (unsigned long long)waits[i].value);
    Py_CLEAR(ptr);
    Py_CLEAR(sig);
    if (!item || PyList_Append(cmds, item)) goto out;
    Py_CLEAR(item);
  }
  if (PyErr_Occurred()) goto out;
  uint32_t index = (uint32_t)nwaits;
  if (pairs) {
    keep = PyList_New(1);
    if (!keep) goto out;
    Py_INCREF(pairs);
    PyList_SET_ITEM(keep, 0, pairs);
    memset(&recs[n], 0, sizeof recs[n]);
    recs[n].kind = K_CHECK;
    recs[n].a = (uint64_t)(uintptr_t)PyBytes_AS_STRING(pairs);
    recs[n].b = (uint64_t)(PyBytes_GET_SIZE(pairs) / 16);
    recs[n].op = id;
    recs[n].index = index | CHECK_BIT;
    n++;
    /* the worker asks the engine's Python thread when an input failed: it must find the op */
    PyObject *python = PyObject_GetAttr(engine, s_python);
    if (!python) goto out;
    int set = PyDict_SetItem(python, op_id, op);
    Py_DECREF(python);
    if (set) goto out;
    PyObject *thread = PyObject_GetAttr(engine, s_thread);
    if (!thread) goto out;
    int started = thread != Py_None;
    Py_DECREF(thread);
    if (!started) {
      PyObject *r = PyObject_CallMethodOneArg(engine, s_python_runs, op);
      if (!r) goto out;
      Py_DECREF(r);
    }
  }
  recs[n] = *work;
  recs[n].flags = F_END;
  recs[n].op = id;
  recs[n].index = index;
  n++;
  if (PyList_Append(cmds, PyList_GET_ITEM(body, 0))) goto out;
  /* NativeEngine._enqueue: retire in batches, then append */
  PyObject *inflight = PyObject_GetAttr(engine, s_inflight);
  if (!inflight) goto out;
  Py_ssize_t queued = PyObject_Length(inflight);
  if (queued >= RETIRE_EVERY) {
    PyObject *head = PySequence_GetItem(inflight, 0);
    uint64_t reached;
    int r = head ? signal_value(engine, &reached) : -2;
    if (r == 0 && op_value(PyTuple_GET_ITEM(head, 0)) <= reached) {
      PyObject *res = PyObject_CallMethodNoArgs(engine, s_retire);
      if (!res) r = -2;
      Py_XDECREF(res);
    }
    Py_XDECREF(head);
    if (r == -2 || PyErr_Occurred()) {
      Py_DECREF(inflight);
      goto out;
    }
  }
  set_slot(op, S_ENGINE, engine);
  set_slot(op, S_CMDS, cmds);
  if (PyList_GET_SIZE(deps)) set_slot(op, S_DEPS, deps);
  PyObject *address = PyObject_GetAttr(engine, s_address);
  void *eng = address ? PyLong_AsVoidPtr(address) : NULL;
  Py_XDECREF(address);
  uint64_t value = eng ? g_submit(eng, recs, (uint32_t)n) : 0;
  if (!value) {
    if (!PyErr_Occurred()) {
      PyErr_Format(PyExc_MemoryError, "%U: no memory for the commands of its queue", SLOT(op, S_NAME));
      PyObject *python = PyObject_GetAttr(engine, s_python);
      if (python) {
        if (PyDict_DelItem(python, op_id)) PyErr_Clear();
        Py_DECREF(python);
      }
    }
    Py_DECREF(inflight);
    goto out;
  }
  PyObject *v = PyLong_FromUnsignedLongLong(value);
  if (v) {
    set_slot(op, S_VALUE, v);
    Py_DECREF(v);
  }
  item = v ? PyTuple_Pack(2, op, keep) : NULL;
  PyObject *appended = item ? PyObject_CallMethodOneArg(inflight, s_append, item) : NULL;
  Py_DECREF(inflight);
  if (!appended) goto out;
  Py_DECREF(appended);
  rc = 1;
out:
  Py_XDECREF(item);
  Py_XDECREF(ptr);
  Py_XDECREF(sig);
  Py_XDECREF(cmds);
  if (keep != Py_None) Py_DECREF(keep);
  Py_XDECREF(pairs);
  return rc;
}

/* ---- the module's functions --------------------------------------------------------------------------- */

static PyObject *call_lock(PyObject *engine, PyObject *method) {
  PyObject *lock = PyObject_GetAttr(engine, s_lock);
  if (!lock) return NULL;
  PyObject *r = PyObject_CallMethodNoArgs(lock, method);
  Py_DECREF(lock);
  return r;
}

static int engine_closed(PyObject *engine) {
  PyObject *closed = PyObject_GetAttr(engine, s_closed);
  if (!closed) return -1;
  int truth = PyObject_IsTrue(closed);
  Py_DECREF(closed);
  return truth;
}

static PyObject *submit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "submit(engine, name, body, reads, writes, keep, result)");
    return NULL;
  }
  PyObject *engine = args[0], *name = args[1], *body = args[2], *reads = args[3], *writes = args[4];
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
  PyObject *op = new_op(name, args[5], args[6]);
  if (!op) return NULL;
  PyObject *deps = PyList_New(0), *inputs = PyList_New(0);
  if (!deps || !inputs) goto fail;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(reads); i++)
    if (log_access(PyTuple_GET_ITEM(reads, i), 0, op, engine, deps, inputs)) goto fail;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(writes); i++)
    if (log_access(PyTuple_GET_ITEM(writes, i), 1, op, engine, deps, inputs)) goto fail;
  Py_ssize_t ni = PyList_GET_SIZE(inputs);
  if (ni) {
    set_slot(op, S_INPUTS, inputs);
    for (Py_ssize_t i = 0; i < ni; i++) {
      if (SLOT(PyList_GET_ITEM(inputs, i), S_GATE) != Py_None) { /* a request's op: the Python rule */
        PyObject *r = PyObject_CallFunctionObjArgs(g_protect, inputs, Py_None, NULL);
        if (!r) goto fail;
        Py_DECREF(r);
        break;
      }
    }
  }
  PyObject *locked = call_lock(engine, s_acquire);
  if (!locked) goto fail;
  Py_DECREF(locked);
  int pushed = engine_closed(engine);
  if (pushed == 0) pushed = push(engine, op, body, &work, deps, inputs);
  else if (pushed == 1) pushed = PyList_GET_SIZE(deps) ? 0 : 2;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject *unlocked = call_lock(engine, s_release);
  if (type) {
    Py_XDECREF(unlocked);
    PyErr_Restore(type, value, traceback);
    goto fail;
  }
  if (!unlocked) goto fail;
  Py_DECREF(unlocked);
  if (pushed == 2) { /* closed meanwhile, with no dependency: check_open raises, as push does */
    PyObject *r = PyObject_CallMethodOneArg(engine, s_check_open, name);
    Py_XDECREF(r);
    goto fail;
  }
  if (pushed == 0 && PyList_GET_SIZE(deps)) set_slot(op, S_DEPS, deps);
  Py_DECREF(deps);
  Py_DECREF(inputs);
  return op;
fail:
  Py_XDECREF(deps);
  Py_XDECREF(inputs);
  Py_DECREF(op);
  return NULL;
}

static PyObject *init(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *op_type, *native_type, *entry_type, *nothing, *native_copies, *op_ids, *protect, *wait_kind;
  unsigned long long submit_address, held;
  if (!PyArg_ParseTuple(args, "KKOOOOOOOO", &submit_address, &held, &op_type, &native_type, &entry_type, &nothing,
                        &native_copies, &op_ids, &protect, &wait_kind))
    return NULL;
  if (!PyType_Check(op_type) || !PyType_Check(native_type) || !PyType_Check(entry_type) || !PyDict_Check(nothing) ||
      !PyDict_Check(native_copies) || !submit_address) {
    PyErr_SetString(PyExc_TypeError, "init: types, dicts and the address of ar_submit expected");
    return NULL;
  }
  for (int s = 0; s < N_SLOTS; s++) {
    PyObject *d = PyObject_GetAttrString(op_type, slot_names[s]);
    if (!d) return NULL;
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
    if (ok) g_off[s] = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    if (!ok) {
      PyErr_Format(PyExc_TypeError, "init: Op.%s is not a slot", slot_names[s]);
      return NULL;
    }
  }
  g_submit = (submit_fn)(uintptr_t)submit_address;
  g_held = held;
  g_op_type = (PyTypeObject *)Py_NewRef(op_type);
  g_native_type = (PyTypeObject *)Py_NewRef(native_type);
  g_entry_type = (PyTypeObject *)Py_NewRef(entry_type);
  g_nothing = Py_NewRef(nothing);
  g_native_copies = Py_NewRef(native_copies);
  g_op_ids = Py_NewRef(op_ids);
  g_protect = Py_NewRef(protect);
  g_wait_kind = Py_NewRef(wait_kind);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"submit", (PyCFunction)(void (*)(void))submit, METH_FASTCALL,
     "submit(engine, name, body, reads, writes, keep, result): the op, or None for the Python path"},
    {"init", init, METH_VARARGS, "init(ar_submit address, HELD, Op, NativeEngine, Entry, nothing, copies, ids, "
                                 "protect, WAIT)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_submit", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__submit(void) {
  struct {
    PyObject **where;
    const char *text;
  } names[] = {
      {&s_log, "log"},          {&s_offset, "offset"},     {&s_nbytes, "nbytes"},     {&s_entries, "entries"},
      {&s_signal, "signal"},    {&s_ptr, "ptr"},           {&s_timeout, "timeout"},   {&s_closed, "closed"},
      {&s_lock, "_lock"},       {&s_inflight, "_inflight"}, {&s_retire, "retire"},    {&s_done, "done"},
      {&s_dispatched, "dispatched"}, {&s_address, "address"}, {&s_python, "_python"}, {&s_thread, "_thread"},
      {&s_python_runs, "_python_runs"}, {&s_check_open, "check_open"}, {&s_acquire, "acquire"},
      {&s_release, "release"},  {&s_append, "append"},
      {&s_failures, "failures"}, {&s_failures_seen, "failures_seen"}, {&s_failed, "_failed"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    *names[i].where = PyUnicode_InternFromString(names[i].text);
    if (!*names[i].where) return NULL;
  }
  return PyModule_Create(&module);
}
