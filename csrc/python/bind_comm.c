/* bind_comm.c - zero_ext._C's communicator (comm.h) as the heap types Comm and CommOp.
 *
 * Buffers arrive as addresses and byte or element counts (zero_ext/comm/native.py checks the tensors
 * and keeps them alive until the op is waited for). Creating, waiting and destroying run without the
 * GIL: they wait on other processes. A failed op raises OSError(errno, message): TimeoutError,
 * BrokenPipeError (a rank died) or ConnectionResetError (a rank left), with the message of comm.h.
 */
#include "bindings.h"

#include <errno.h>
#include <string.h>

#include "comm.h"

static PyTypeObject *comm_op_type; /* set at exec; sub-interpreters are not supported (module.c) */

typedef struct {
	PyObject_HEAD
	struct zx_comm *comm; /* NULL once destroyed */
} comm_object;

typedef struct {
	PyObject_HEAD
	struct zx_comm_op *op;
	PyObject *comm; /* the Comm, alive while the op is */
	PyObject *keep; /* what owns the op's buffers: released only after the op ran */
} comm_op_object;

static PyObject *raise_op(int status, const char *message)
{
	PyObject *args = Py_BuildValue("(is)", -status, message);
	if (args) {
		PyErr_SetObject(PyExc_OSError, args);
		Py_DECREF(args);
	}
	return NULL;
}

static struct zx_comm *comm_live(comm_object *self)
{
	if (!self->comm)
		PyErr_SetString(PyExc_ValueError, "the communicator was destroyed");
	return self->comm;
}

static PyTypeObject *comm_type; /* set at exec, as comm_op_type */

struct zx_comm *zx_comm_of(PyObject *obj)
{
	if (!PyObject_TypeCheck(obj, comm_type)) {
		PyErr_SetString(PyExc_TypeError, "a zero_ext._C.Comm is required");
		return NULL;
	}
	return comm_live((comm_object *)obj);
}

PyObject *zx_comm_raise(int status, const char *message)
{
	return raise_op(status, message);
}

/* ---------------------------------------------------------------------------------------------------
 * CommOp */

static PyObject *op_wrap(comm_object *comm, int rc, struct zx_comm_op *op, const char *verb)
{
	if (rc < 0)
		return zx_raise(rc, verb);
	comm_op_object *self = PyObject_New(comm_op_object, comm_op_type);
	if (!self) {
		Py_BEGIN_ALLOW_THREADS
		zx_comm_wait(op);
		Py_END_ALLOW_THREADS
		zx_comm_op_free(op);
		return NULL;
	}
	self->op = op;
	self->comm = Py_NewRef((PyObject *)comm);
	self->keep = NULL;
	return (PyObject *)self;
}

static PyObject *op_wait(PyObject *obj, PyObject *unused)
{
	comm_op_object *self = (comm_op_object *)obj;
	int rc;
	if (zx_comm_test(self->op)) {
		rc = zx_comm_wait(self->op);
	} else {
		Py_BEGIN_ALLOW_THREADS
		rc = zx_comm_wait(self->op);
		Py_END_ALLOW_THREADS
	}
	if (rc < 0)
		return raise_op(rc, zx_comm_op_error(self->op));
	Py_RETURN_NONE;
}

static PyObject *op_test(PyObject *obj, PyObject *unused)
{
	return PyBool_FromLong(zx_comm_test(((comm_op_object *)obj)->op));
}

static void op_dealloc(PyObject *obj)
{
	comm_op_object *self = (comm_op_object *)obj;
	PyTypeObject *tp = Py_TYPE(obj);
	if (!zx_comm_test(self->op)) { /* its buffers must outlive it */
		Py_BEGIN_ALLOW_THREADS
		zx_comm_wait(self->op);
		Py_END_ALLOW_THREADS
	}
	zx_comm_op_free(self->op);
	Py_CLEAR(self->keep);
	Py_CLEAR(self->comm);
	PyObject_Free(obj);
	Py_DECREF(tp);
}

static PyObject *op_get_keep(PyObject *obj, void *unused)
{
	PyObject *keep = ((comm_op_object *)obj)->keep;
	return Py_NewRef(keep ? keep : Py_None);
}

static int op_set_keep(PyObject *obj, PyObject *value, void *unused)
{
	Py_XSETREF(((comm_op_object *)obj)->keep, Py_XNewRef(value));
	return 0;
}

static PyGetSetDef op_getset[] = {
	{ "keep", op_get_keep, op_set_keep, "what owns the buffers (released after the op ran)", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyMethodDef op_methods[] = {
	{ "wait", op_wait, METH_NOARGS, "Blocks until the op ran; raises OSError when it failed." },
	{ "test", op_test, METH_NOARGS, "Whether the op ran (wait() then returns at once)." },
	{ NULL, NULL, 0, NULL },
};

static PyType_Slot op_slots[] = {
	{ Py_tp_doc, (void *)"An op of a Comm: wait() or test()." },
	{ Py_tp_dealloc, op_dealloc },
	{ Py_tp_methods, op_methods },
	{ Py_tp_getset, op_getset },
	{ 0, NULL },
};

static PyType_Spec op_spec = {
	.name = "zero_ext._C.CommOp",
	.basicsize = sizeof(comm_op_object),
	.flags = Py_TPFLAGS_DEFAULT,
	.slots = op_slots,
};

/* ---------------------------------------------------------------------------------------------------
 * Comm */

static PyObject *comm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
	static char *kw[] = { "id", "rank", "world", "timeout_s", "slot_bytes", NULL };
	const char *id;
	int rank, world;
	double timeout_s;
	long long slot_bytes = 0;
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "siid|L:Comm", kw, &id, &rank, &world, &timeout_s,
					 &slot_bytes))
		return NULL;
	struct zx_comm *comm = NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_comm_create(&comm, ZX_COMM_SHM, id, rank, world, timeout_s, slot_bytes);
	Py_END_ALLOW_THREADS
	if (rc < 0) {
		char msg[ZX_COMM_ERROR_BYTES];
		snprintf(msg, sizeof(msg), "cannot join communicator %s as rank %d of %d: %s", id, rank, world,
			 strerror(-rc));
		return raise_op(rc, msg);
	}
	comm_object *self = (comm_object *)type->tp_alloc(type, 0);
	if (!self) {
		zx_comm_destroy(comm);
		return NULL;
	}
	self->comm = comm;
	return (PyObject *)self;
}

static void comm_shutdown(comm_object *self)
{
	struct zx_comm *comm = self->comm;
	self->comm = NULL;
	if (comm) {
		Py_BEGIN_ALLOW_THREADS
		zx_comm_destroy(comm);
		Py_END_ALLOW_THREADS
	}
}

static void comm_dealloc(PyObject *obj)
{
	PyTypeObject *tp = Py_TYPE(obj);
	comm_shutdown((comm_object *)obj);
	freefunc tp_free = PyType_GetSlot(tp, Py_tp_free);
	tp_free(obj);
	Py_DECREF(tp);
}

static PyObject *comm_destroy(PyObject *obj, PyObject *unused)
{
	comm_shutdown((comm_object *)obj);
	Py_RETURN_NONE;
}

static PyObject *comm_unlink(PyObject *obj, PyObject *unused)
{
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm)
		return NULL;
	int rc = zx_comm_unlink(comm);
	return rc < 0 ? zx_raise(rc, "Comm.unlink") : Py_NewRef(Py_None);
}


static PyObject *comm_all_gather(PyObject *obj, PyObject *args)
{
	unsigned long long in, out;
	long long bytes;
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm || !PyArg_ParseTuple(args, "KKL:all_gather", &in, &out, &bytes))
		return NULL;
	struct zx_comm_op *op;
	int rc = zx_comm_all_gather(comm, PTR(in), PTR(out), bytes, &op);
	return op_wrap((comm_object *)obj, rc, op, "all_gather");
}

static PyObject *comm_all_gather_group(PyObject *obj, PyObject *args)
{
	PyObject *ins, *outs, *sizes;
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm || !PyArg_ParseTuple(args, "OOO:all_gather_group", &ins, &outs, &sizes))
		return NULL;
	Py_ssize_t n1 = 0, n2 = 0, n3 = 0;
	int64_t *a = zx_int64_array(ins, &n1, "ins"), *b = a ? zx_int64_array(outs, &n2, "outs") : NULL;
	int64_t *c = b ? zx_int64_array(sizes, &n3, "sizes") : NULL;
	PyObject *result = NULL;
	if (c && (n1 != n2 || n1 != n3 || n1 > INT32_MAX)) {
		PyErr_SetString(PyExc_ValueError, "all_gather_group: ins, outs and sizes differ in length");
	} else if (c) {
		_Static_assert(sizeof(int64_t) == sizeof(void *), "addresses are 64-bit");
		struct zx_comm_op *op;
		int rc = zx_comm_all_gather_group(comm, (int)n1, (const void *const *)a, (void *const *)b, c, &op);
		result = op_wrap((comm_object *)obj, rc, op, "all_gather_group");
	}
	PyMem_Free(a);
	PyMem_Free(b);
	PyMem_Free(c);
	return result;
}

static PyObject *comm_all_gather_v(PyObject *obj, PyObject *args)
{
	unsigned long long in, out;
	PyObject *counts;
	comm_object *self = (comm_object *)obj;
	struct zx_comm *comm = comm_live(self);
	if (!comm || !PyArg_ParseTuple(args, "KKO:all_gather_v", &in, &out, &counts))
		return NULL;
	Py_ssize_t n = 0;
	int64_t *v = zx_int64_array(counts, &n, "counts");
	if (!v)
		return NULL;
	PyObject *result = NULL;
	if (n != zx_comm_world(comm)) {
		PyErr_Format(PyExc_ValueError, "all_gather_v: %zd counts for %d ranks", n, zx_comm_world(comm));
	} else {
		struct zx_comm_op *op;
		int rc = zx_comm_all_gather_v(comm, PTR(in), PTR(out), v, &op);
		result = op_wrap(self, rc, op, "all_gather_v");
	}
	PyMem_Free(v);
	return result;
}

static PyObject *comm_all_to_all(PyObject *obj, PyObject *args)
{
	unsigned long long in, out;
	long long bytes;
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm || !PyArg_ParseTuple(args, "KKL:all_to_all", &in, &out, &bytes))
		return NULL;
	struct zx_comm_op *op;
	int rc = zx_comm_all_to_all(comm, PTR(in), PTR(out), bytes, &op);
	return op_wrap((comm_object *)obj, rc, op, "all_to_all");
}

static PyObject *comm_all_to_all_v(PyObject *obj, PyObject *args)
{
	unsigned long long in, out;
	PyObject *counts;
	comm_object *self = (comm_object *)obj;
	struct zx_comm *comm = comm_live(self);
	if (!comm || !PyArg_ParseTuple(args, "KKO:all_to_all_v", &in, &out, &counts))
		return NULL;
	Py_ssize_t n = 0;
	int64_t *v = zx_int64_array(counts, &n, "counts");
	if (!v)
		return NULL;
	PyObject *result = NULL;
	int world = zx_comm_world(comm);
	if (n != (Py_ssize_t)world * world) {
		PyErr_Format(PyExc_ValueError, "all_to_all_v: %zd counts for %d x %d ranks", n, world, world);
	} else {
		struct zx_comm_op *op;
		int rc = zx_comm_all_to_all_v(comm, PTR(in), PTR(out), v, &op);
		result = op_wrap(self, rc, op, "all_to_all_v");
	}
	PyMem_Free(v);
	return result;
}

/* reduce_scatter / all_reduce / reduce(in, out, count, dtype, redop, scale[, root]) */
static PyObject *comm_reduction(PyObject *obj, PyObject *args, int verb)
{
	static const char *formats[] = { "KKLiid:reduce_scatter", "KKLiid:all_reduce", "KKLiidi:reduce" };
	unsigned long long in, out;
	long long count;
	int dtype, redop, root = 0;
	double scale;
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm || !PyArg_ParseTuple(args, formats[verb], &in, &out, &count, &dtype, &redop, &scale, &root))
		return NULL;
	struct zx_comm_op *op;
	int rc = verb == 0   ? zx_comm_reduce_scatter(comm, PTR(in), PTR(out), count, dtype, redop, scale, &op)
		 : verb == 1 ? zx_comm_all_reduce(comm, PTR(in), PTR(out), count, dtype, redop, scale, &op)
			     : zx_comm_reduce(comm, PTR(in), PTR(out), count, dtype, redop, scale, root, &op);
	return op_wrap((comm_object *)obj, rc, op, formats[verb] + 7);
}

static PyObject *comm_reduce_scatter(PyObject *obj, PyObject *args) { return comm_reduction(obj, args, 0); }
static PyObject *comm_all_reduce(PyObject *obj, PyObject *args) { return comm_reduction(obj, args, 1); }
static PyObject *comm_reduce(PyObject *obj, PyObject *args) { return comm_reduction(obj, args, 2); }

static PyObject *comm_broadcast(PyObject *obj, PyObject *args)
{
	unsigned long long buf;
	long long bytes;
	int root;
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm || !PyArg_ParseTuple(args, "KLi:broadcast", &buf, &bytes, &root))
		return NULL;
	struct zx_comm_op *op;
	int rc = zx_comm_broadcast(comm, PTR(buf), bytes, root, &op);
	return op_wrap((comm_object *)obj, rc, op, "broadcast");
}

static PyObject *comm_scatter(PyObject *obj, PyObject *args)
{
	unsigned long long in, out;
	long long bytes;
	int root;
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm || !PyArg_ParseTuple(args, "KKLi:scatter", &in, &out, &bytes, &root))
		return NULL;
	struct zx_comm_op *op;
	int rc = zx_comm_scatter(comm, PTR(in), PTR(out), bytes, root, &op);
	return op_wrap((comm_object *)obj, rc, op, "scatter");
}

static PyObject *comm_barrier(PyObject *obj, PyObject *unused)
{
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm)
		return NULL;
	struct zx_comm_op *op;
	int rc = zx_comm_barrier(comm, &op);
	return op_wrap((comm_object *)obj, rc, op, "barrier");
}

static PyObject *comm_agree(PyObject *obj, PyObject *args)
{
	const char *label;
	double timeout_s = 0;
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm || !PyArg_ParseTuple(args, "s|d:agree", &label, &timeout_s))
		return NULL;
	struct zx_comm_op *op;
	int rc = zx_comm_agree(comm, label, timeout_s, &op);
	return op_wrap((comm_object *)obj, rc, op, "agree");
}

static PyObject *comm_defer_next(PyObject *obj, PyObject *args)
{
	int on = 1;
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm || !PyArg_ParseTuple(args, "|p:defer_next", &on))
		return NULL;
	zx_comm_defer_next(comm, on);
	Py_RETURN_NONE;
}

static PyObject *comm_get_int(PyObject *obj, void *which)
{
	struct zx_comm *comm = comm_live((comm_object *)obj);
	if (!comm)
		return NULL;
	switch ((int)(intptr_t)which) {
	case 0: return PyLong_FromLong(zx_comm_rank(comm));
	case 1: return PyLong_FromLong(zx_comm_world(comm));
	case 2: return PyLong_FromLongLong(zx_comm_segment_bytes(comm));
	case 3: return PyLong_FromLongLong(zx_comm_ops(comm));
	default: return PyLong_FromLongLong(zx_comm_handed_off(comm));
	}
}

static PyObject *comm_get_destroyed(PyObject *obj, void *unused)
{
	return PyBool_FromLong(((comm_object *)obj)->comm == NULL);
}

static PyMethodDef comm_methods[] = {
	{ "all_gather", comm_all_gather, METH_VARARGS, "all_gather(in, out, nbytes) -> CommOp" },
	{ "all_gather_group", comm_all_gather_group, METH_VARARGS,
	  "all_gather_group(ins, outs, nbytes) -> CommOp: lists of addresses and byte counts" },
	{ "all_gather_v", comm_all_gather_v, METH_VARARGS, "all_gather_v(in, out, counts) -> CommOp (bytes)" },
	{ "all_to_all", comm_all_to_all, METH_VARARGS,
	  "all_to_all(in, out, nbytes) -> CommOp: chunk d of in (nbytes each) to rank d" },
	{ "all_to_all_v", comm_all_to_all_v, METH_VARARGS,
	  "all_to_all_v(in, out, counts) -> CommOp: counts[s * world + d] bytes from rank s to rank d" },
	{ "reduce_scatter", comm_reduce_scatter, METH_VARARGS,
	  "reduce_scatter(in, out, count, dtype, redop, scale) -> CommOp" },
	{ "all_reduce", comm_all_reduce, METH_VARARGS, "all_reduce(in, out, count, dtype, redop, scale) -> CommOp" },
	{ "reduce", comm_reduce, METH_VARARGS, "reduce(in, out, count, dtype, redop, scale, root) -> CommOp" },
	{ "broadcast", comm_broadcast, METH_VARARGS, "broadcast(buf, nbytes, root) -> CommOp" },
	{ "scatter", comm_scatter, METH_VARARGS, "scatter(in, out, nbytes, root) -> CommOp" },
	{ "barrier", comm_barrier, METH_NOARGS, "barrier() -> CommOp" },
	{ "agree", comm_agree, METH_VARARGS,
	  "agree(label, timeout_s=0) -> CommOp: a barrier the ranks pass only under the same label" },
	{ "defer_next", comm_defer_next, METH_VARARGS,
	  "defer_next(on=True): the next op is waited for at once by its caller (no progress-thread wake-up)" },
	{ "unlink", comm_unlink, METH_NOARGS, "Rank 0, once every rank joined: removes the segment's name." },
	{ "destroy", comm_destroy, METH_NOARGS, "Waits for the ops in flight, leaves, frees (idempotent)." },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef comm_getset[] = {
	{ "rank", comm_get_int, NULL, "this rank", (void *)0 },
	{ "world", comm_get_int, NULL, "ranks of the communicator", (void *)1 },
	{ "segment_bytes", comm_get_int, NULL, "bytes of shared memory mapped", (void *)2 },
	{ "ops", comm_get_int, NULL, "ops enqueued so far", (void *)3 },
	{ "handed_off", comm_get_int, NULL, "ops the progress thread ran (the rest: on their waiter's thread)",
	  (void *)4 },
	{ "destroyed", comm_get_destroyed, NULL, "whether destroy() ran", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyType_Slot comm_slots[] = {
	{ Py_tp_doc, (void *)"Comm(id, rank, world, timeout_s, slot_bytes=0): a shared-memory communicator "
			     "(comm.h). Use zero_ext.comm.native, which checks tensors." },
	{ Py_tp_new, comm_new },
	{ Py_tp_dealloc, comm_dealloc },
	{ Py_tp_methods, comm_methods },
	{ Py_tp_getset, comm_getset },
	{ 0, NULL },
};

static PyType_Spec comm_spec = {
	.name = "zero_ext._C.Comm",
	.basicsize = sizeof(comm_object),
	.flags = Py_TPFLAGS_DEFAULT,
	.slots = comm_slots,
};

int zx_comm_exec(PyObject *module)
{
	PyObject *op_type = PyType_FromModuleAndSpec(module, &op_spec, NULL);
	if (!op_type)
		return -1;
	comm_op_type = (PyTypeObject *)op_type; /* the module keeps it alive */
	int rc = PyModule_AddObjectRef(module, "CommOp", op_type);
	Py_DECREF(op_type);
	PyObject *type = rc < 0 ? NULL : PyType_FromModuleAndSpec(module, &comm_spec, NULL);
	if (!type)
		return -1;
	comm_type = (PyTypeObject *)type;
	rc = PyModule_AddObjectRef(module, "Comm", type);
	Py_DECREF(type);
	return rc;
}

/* ---------------------------------------------------------------------------------------------------
 * Module functions */

static PyObject *py_comm_unique_id(PyObject *self, PyObject *unused)
{
	char id[ZX_COMM_ID_BYTES];
	int rc = zx_comm_unique_id(ZX_COMM_SHM, id);
	return rc < 0 ? zx_raise(rc, "comm_unique_id") : PyUnicode_FromString(id);
}

static PyObject *py_comm_reduce_kernel(PyObject *self, PyObject *args)
{
	int dtype, redop, isa;
	double scale;
	PyObject *srcs;
	unsigned long long dst, dst2 = 0;
	long long count;
	if (!PyArg_ParseTuple(args, "iidOKLi|K:comm_reduce_kernel", &dtype, &redop, &scale, &srcs, &dst, &count,
			      &isa, &dst2))
		return NULL;
	Py_ssize_t n = 0;
	int64_t *v = zx_int64_array(srcs, &n, "srcs");
	if (!v)
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_comm_reduce_kernel2(dtype, redop, scale, (const void *const *)v, (int)n, PTR(dst), PTR(dst2), count,
				    isa);
	Py_END_ALLOW_THREADS
	PyMem_Free(v);
	return rc < 0 ? zx_raise(rc, "comm_reduce_kernel") : Py_NewRef(Py_None);
}

PyMethodDef zx_comm_methods[] = {
	{ "comm_unique_id", py_comm_unique_id, METH_NOARGS,
	  "comm_unique_id() -> str: a fresh communicator id (and stale segments of killed runs reaped)" },
	{ "comm_reduce_kernel", py_comm_reduce_kernel, METH_VARARGS,
	  "comm_reduce_kernel(dtype, redop, scale, srcs, dst, count, isa, dst2=0): the collectives' "
	  "reduction kernel on addresses (isa -1: the best, 0: the scalar reference; dst2: a second copy)" },
	{ NULL, NULL, 0, NULL },
};
