/* bind_aio.c - zero_ext._C's NVMe I/O handle (aio.h) as the heap type AioHandle. */
#include "bindings.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "aio.h"
#include "checksum.h"

/* ---------------------------------------------------------------------------------------------------
 * NVMe I/O (aio.h) */

/* _C.AioHandle: a struct zx_aio as a Python object (a heap type, so dealloc releases the workers).
 * The ops read and write memory that Python objects own (tensors), so each op holds a reference to
 * its `owner` until it is waited for, and close() and dealloc wait for every op in flight before
 * they let the owners go. No Py_TPFLAGS_BASETYPE: zero_ext/nvme/aio.py wraps it rather than subclassing. */
typedef struct {
	PyObject_HEAD
	struct zx_aio *aio; /* NULL once closed */
	PyObject *owners;   /* dict: op id -> object kept alive until the op is waited for */
	PyObject *registered; /* what owns the memory of register_buffers' ranges, or NULL */
	int busy;	    /* calls running without the GIL; close() refuses while > 0 */
} zx_aio_object;

static const char *const zx_aio_backend_names[] = { "auto", "uring", "threads" };

/* The live handle of self, or NULL with ValueError when it is closed. */
static struct zx_aio *aio_live(zx_aio_object *self)
{
	if (!self->aio)
		PyErr_SetString(PyExc_ValueError, "I/O operation on a closed AioHandle");
	return self->aio;
}

/* The op id in arg and the live handle of self (wait, done); NULL with the exception set. */
static struct zx_aio *aio_op_arg(zx_aio_object *self, PyObject *arg, long long *id)
{
	*id = PyLong_AsLongLong(arg);
	if (*id == -1 && PyErr_Occurred())
		return NULL;
	return aio_live(self);
}

/* Stops the handle: pending requests cancelled, those in flight waited for (GIL released). */
static void aio_shutdown(zx_aio_object *self)
{
	struct zx_aio *aio = self->aio;
	self->aio = NULL; /* before the GIL goes: no other thread may start a call on it */
	if (aio) {
		Py_BEGIN_ALLOW_THREADS
		zx_aio_exit(aio);
		Py_END_ALLOW_THREADS
	}
	if (self->owners)
		PyDict_Clear(self->owners);
	Py_CLEAR(self->registered); /* the rings, and so the kernel's hold on the pages, are gone */
}

static PyObject *aio_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
	static char *kw[] = { "block_size", "queue_depth", "threads", "single_submit",
			      "overlap_events", "backend", NULL };
	struct zx_aio_params p = { .block_size = 1 << 20, .queue_depth = 8, .threads = 1,
				   .single_submit = 0, .overlap_events = 1, .backend = ZX_AIO_AUTO };
	const char *backend = "auto";
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|Liipps:AioHandle", kw, &p.block_size,
					 &p.queue_depth, &p.threads, &p.single_submit,
					 &p.overlap_events, &backend))
		return NULL;
	for (p.backend = 0; p.backend < 3 && strcmp(backend, zx_aio_backend_names[p.backend]);)
		p.backend++;
	if (p.backend == 3) {
		PyErr_Format(PyExc_ValueError, "AioHandle: backend must be auto, uring or threads, not %s",
			     backend);
		return NULL;
	}
	zx_aio_object *self = (zx_aio_object *)type->tp_alloc(type, 0);
	if (!self)
		return NULL;
	self->owners = PyDict_New();
	if (!self->owners) {
		Py_DECREF(self);
		return NULL;
	}
	int rc;
	Py_BEGIN_ALLOW_THREADS /* probes io_uring and starts threads */
	rc = zx_aio_init(&self->aio, &p);
	Py_END_ALLOW_THREADS
	if (rc) {
		Py_DECREF(self);
		if (rc == -EINVAL) {
			PyErr_Format(PyExc_ValueError,
				     "AioHandle: block_size must be a positive multiple of %d up to %d, "
				     "queue_depth 1..%d, threads 1..%d",
				     ZX_AIO_ALIGN, ZX_AIO_MAX_BLOCK, ZX_AIO_MAX_DEPTH, ZX_AIO_MAX_WORKERS);
			return NULL;
		}
		return zx_raise(rc, "AioHandle");
	}
	return (PyObject *)self;
}

static void aio_dealloc(PyObject *op)
{
	zx_aio_object *self = (zx_aio_object *)op;
	PyTypeObject *tp = Py_TYPE(op);
	aio_shutdown(self);
	Py_CLEAR(self->owners);
	Py_CLEAR(self->registered);
	freefunc tp_free = PyType_GetSlot(tp, Py_tp_free);
	tp_free(op);
	Py_DECREF(tp);
}

static PyObject *aio_submit(zx_aio_object *self, PyObject *args, int write)
{
	int fd;
	unsigned long long ptr;
	long long nbytes, offset;
	PyObject *owner;
	if (!PyArg_ParseTuple(args, write ? "iKLLO:submit_write" : "iKLLO:submit_read", &fd, &ptr,
			      &nbytes, &offset, &owner))
		return NULL;
	struct zx_aio *aio = aio_live(self);
	if (!aio)
		return NULL;
	void *buf = (void *)(uintptr_t)ptr;
	int64_t id;
	self->busy++;
	Py_BEGIN_ALLOW_THREADS
	id = write ? zx_aio_submit_write(aio, fd, buf, nbytes, offset)
		   : zx_aio_submit_read(aio, fd, buf, nbytes, offset);
	Py_END_ALLOW_THREADS
	self->busy--;
	if (id < 0)
		return zx_raise(id, write ? "AioHandle.submit_write" : "AioHandle.submit_read");
	PyObject *key = PyLong_FromLongLong(id);
	if (!key || PyDict_SetItem(self->owners, key, owner)) {
		/* the op runs but its buffer's owner could not be recorded: finish it before failing */
		PyObject *type, *value, *tb;
		PyErr_Fetch(&type, &value, &tb);
		Py_BEGIN_ALLOW_THREADS
		zx_aio_wait(aio, id, NULL);
		Py_END_ALLOW_THREADS
		PyErr_Restore(type, value, tb);
		Py_XDECREF(key);
		return NULL;
	}
	return key;
}

PyDoc_STRVAR(aio_submit_read_doc,
	     "submit_read(fd, ptr, nbytes, offset, owner) -> op\n\n"
	     "Queues a read of nbytes from fd at offset (a multiple of 4096) into memory at ptr and\n"
	     "returns the op id at once. owner (the tensor) is kept alive until the op is waited for;\n"
	     "fd may be closed at once (the op has its own duplicate).");

static PyObject *aio_submit_read(PyObject *self, PyObject *args)
{
	return aio_submit((zx_aio_object *)self, args, 0);
}

PyDoc_STRVAR(aio_submit_write_doc,
	     "submit_write(fd, ptr, nbytes, offset, owner) -> op\n\n"
	     "As submit_read, for a write; writes nbytes rounded up to 4096 (tail zero-filled).");

static PyObject *aio_submit_write(PyObject *self, PyObject *args)
{
	return aio_submit((zx_aio_object *)self, args, 1);
}

PyDoc_STRVAR(aio_wait_doc,
	     "wait(op) -> None | (errno, short, offset, length, done)\n\n"
	     "Blocks (GIL released) until op has finished and forgets it. None on success; on failure\n"
	     "the first failed request: its errno, whether it was a short transfer without errno, its\n"
	     "file offset, the bytes it had to move and those it moved. The caller names the file.");

static PyObject *aio_wait(PyObject *op, PyObject *arg)
{
	zx_aio_object *self = (zx_aio_object *)op;
	long long id;
	struct zx_aio *aio = aio_op_arg(self, arg, &id);
	if (!aio)
		return NULL;
	struct zx_aio_result res;
	int rc;
	self->busy++;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_aio_wait(aio, id, &res);
	Py_END_ALLOW_THREADS
	self->busy--;
	if (rc == -ENOENT || rc == -EBUSY) {
		PyErr_Format(rc == -ENOENT ? PyExc_ValueError : PyExc_RuntimeError,
			     rc == -ENOENT ? "AioHandle.wait: op %lld is not pending (never submitted, or "
					     "already waited for)"
					   : "AioHandle.wait: another thread waits for op %lld",
			     id);
		return NULL;
	}
	if (PyDict_DelItem(self->owners, arg)) /* the op no longer touches its buffer */
		PyErr_Clear();
	if (!rc)
		Py_RETURN_NONE;
	return Py_BuildValue("(iOLLL)", -res.error, res.short_io ? Py_True : Py_False,
			     (long long)res.offset, (long long)res.length, (long long)res.done);
}

PyDoc_STRVAR(aio_done_doc, "done(op) -> bool: whether op has finished (wait(op) will not block)");

static PyObject *aio_done(PyObject *op, PyObject *arg)
{
	zx_aio_object *self = (zx_aio_object *)op;
	long long id;
	struct zx_aio *aio = aio_op_arg(self, arg, &id);
	if (!aio)
		return NULL;
	int rc = zx_aio_done(aio, id);
	if (rc < 0) {
		PyErr_Format(PyExc_ValueError, "AioHandle.done: op %lld is not pending", id);
		return NULL;
	}
	return PyBool_FromLong(rc);
}

PyDoc_STRVAR(aio_register_buffers_doc,
	     "register_buffers(ranges, owner)\n\n"
	     "Registers memory with the io_uring workers (fixed-buffer I/O: pages pinned once, not per\n"
	     "request): ranges is a sequence of (ptr, nbytes) and replaces the set registered before;\n"
	     "an empty one unregisters. owner (the tensors) is kept alive until the next call or close.\n"
	     "Raises OSError: EOPNOTSUPP for the thread backend, or the kernel's errno (ENOMEM past\n"
	     "RLIMIT_MEMLOCK), after which nothing is registered.");

static PyObject *aio_register_buffers(PyObject *op, PyObject *args)
{
	zx_aio_object *self = (zx_aio_object *)op;
	PyObject *ranges, *owner;
	if (!PyArg_ParseTuple(args, "OO:register_buffers", &ranges, &owner))
		return NULL;
	struct zx_aio *aio = aio_live(self);
	if (!aio)
		return NULL;
	PyObject *seq = PySequence_Fast(ranges, "register_buffers: ranges must be a sequence");
	if (!seq)
		return NULL;
	Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
	if (n > ZX_AIO_MAX_REGISTERED) {
		Py_DECREF(seq);
		return PyErr_Format(PyExc_ValueError, "register_buffers: at most %d ranges",
				    ZX_AIO_MAX_REGISTERED);
	}
	void **bufs = PyMem_Calloc((size_t)n + 1, sizeof(*bufs));
	int64_t *lens = PyMem_Calloc((size_t)n + 1, sizeof(*lens));
	int rc = 0;
	if (!bufs || !lens) {
		PyErr_NoMemory();
		goto out;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		unsigned long long ptr;
		long long len;
		if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KL:register_buffers range", &ptr,
				      &len))
			goto out;
		bufs[i] = (void *)(uintptr_t)ptr;
		lens[i] = len;
	}
	self->busy++;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_aio_register_buffers(aio, bufs, lens, (int)n);
	Py_END_ALLOW_THREADS
	self->busy--;
	/* on failure nothing stays registered, so nothing needs keeping either */
	PyObject *keep = rc == 0 && n > 0 ? owner : NULL;
	Py_XINCREF(keep);
	Py_XSETREF(self->registered, keep);
	if (rc)
		zx_raise(rc, "AioHandle.register_buffers");
out:
	PyMem_Free(bufs);
	PyMem_Free(lens);
	Py_DECREF(seq);
	if (PyErr_Occurred())
		return NULL;
	Py_RETURN_NONE;
}

PyDoc_STRVAR(aio_pending_doc, "pending() -> ops submitted and not yet waited for");

static PyObject *aio_pending(PyObject *op, PyObject *unused)
{
	struct zx_aio *aio = aio_live((zx_aio_object *)op);
	return aio ? PyLong_FromLongLong(zx_aio_pending(aio)) : NULL;
}

PyDoc_STRVAR(aio_close_doc,
	     "close()\n\n"
	     "Cancels requests not started, waits (GIL released) for those in flight, stops the\n"
	     "workers and releases every op's owner. Idempotent; dealloc does the same.");

static PyObject *aio_close(PyObject *op, PyObject *unused)
{
	zx_aio_object *self = (zx_aio_object *)op;
	if (self->busy) {
		PyErr_SetString(PyExc_RuntimeError,
				"AioHandle.close: another thread is inside a call on this handle");
		return NULL;
	}
	aio_shutdown(self);
	Py_RETURN_NONE;
}

static PyObject *aio_get_backend(PyObject *op, void *closure)
{
	zx_aio_object *self = (zx_aio_object *)op;
	if (!self->aio)
		Py_RETURN_NONE;
	return PyUnicode_FromString(zx_aio_backend_names[zx_aio_backend(self->aio)]);
}

static PyObject *aio_get_fixed_requests(PyObject *op, void *closure)
{
	zx_aio_object *self = (zx_aio_object *)op;
	if (!self->aio)
		return PyLong_FromLong(0);
	return PyLong_FromLongLong(zx_aio_fixed_requests(self->aio));
}

static PyObject *aio_get_closed(PyObject *op, void *closure)
{
	return PyBool_FromLong(((zx_aio_object *)op)->aio == NULL);
}

static PyMethodDef aio_methods[] = {
	{ "submit_read", aio_submit_read, METH_VARARGS, aio_submit_read_doc },
	{ "submit_write", aio_submit_write, METH_VARARGS, aio_submit_write_doc },
	{ "wait", aio_wait, METH_O, aio_wait_doc },
	{ "done", aio_done, METH_O, aio_done_doc },
	{ "pending", aio_pending, METH_NOARGS, aio_pending_doc },
	{ "register_buffers", aio_register_buffers, METH_VARARGS, aio_register_buffers_doc },
	{ "close", aio_close, METH_NOARGS, aio_close_doc },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef aio_getset[] = {
	{ "backend", aio_get_backend, NULL, "'uring' or 'threads' (None once closed)", NULL },
	{ "closed", aio_get_closed, NULL, "whether close() has run", NULL },
	{ "fixed_requests", aio_get_fixed_requests, NULL,
	  "requests that went through a registered buffer so far (0 once closed)", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

PyDoc_STRVAR(aio_handle_doc,
	     "AioHandle(block_size=1048576, queue_depth=8, threads=1, single_submit=False,\n"
	     "          overlap_events=True, backend='auto')\n\n"
	     "Asynchronous file I/O over io_uring, or a pread/pwrite thread pool (backend 'threads',\n"
	     "or 'auto' where the kernel refuses io_uring). The aio config section's settings;\n"
	     "threads is intra_op_parallelism. Use zero_ext.nvme.aio.AsyncIO, which checks tensors and\n"
	     "names files in its errors.");

static PyType_Slot aio_type_slots[] = {
	{ Py_tp_doc, (void *)aio_handle_doc },
	{ Py_tp_new, aio_new },
	{ Py_tp_dealloc, aio_dealloc },
	{ Py_tp_methods, aio_methods },
	{ Py_tp_getset, aio_getset },
	{ 0, NULL },
};

static PyType_Spec aio_type_spec = {
	.name = "zero_ext._C.AioHandle",
	.basicsize = sizeof(zx_aio_object),
#ifdef Py_TPFLAGS_IMMUTABLETYPE
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
#else
	.flags = Py_TPFLAGS_DEFAULT,
#endif
	.slots = aio_type_slots,
};

/* Py_mod_exec: adds the AioHandle type to the module. */
int zx_aio_exec(PyObject *module)
{
	PyObject *type = PyType_FromModuleAndSpec(module, &aio_type_spec, NULL);
	if (!type)
		return -1;
	int rc = PyModule_AddObjectRef(module, "AioHandle", type);
	Py_DECREF(type);
	return rc;
}

PyDoc_STRVAR(aio_uring_probe_doc,
	     "aio_uring_probe() -> 0 | errno\n\n"
	     "0 when this process may use io_uring (a no-op completes on a one-entry ring), else the\n"
	     "kernel's errno (ENOSYS: old kernel; EPERM: seccomp or kernel.io_uring_disabled).");

static PyObject *py_aio_uring_probe(PyObject *self, PyObject *unused)
{
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_aio_uring_probe();
	Py_END_ALLOW_THREADS
	return PyLong_FromLong(-rc);
}

/* ---------------------------------------------------------------------------------------------------
 * Checkpoint file checksums (checksum.h) */

PyDoc_STRVAR(crc32c_doc,
	     "crc32c(data, crc=0, table=False) -> int\n\n"
	     "The CRC-32C of `data` (any contiguous buffer: bytes, memoryview, mmap) continuing from `crc`. "
	     "`table`: the portable path (tests).");

static PyObject *py_crc32c(PyObject *self, PyObject *args, PyObject *kwargs)
{
	static char *names[] = { "data", "crc", "table", NULL };
	Py_buffer view;
	unsigned int crc = 0;
	int use_table = 0;
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|Ip:crc32c", names, &view, &crc, &use_table))
		return NULL;
	uint32_t out;
	Py_BEGIN_ALLOW_THREADS
	out = use_table ? zx_crc32c_table(crc, view.buf, (size_t)view.len) : zx_crc32c(crc, view.buf, (size_t)view.len);
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&view);
	return PyLong_FromUnsignedLong(out);
}

PyMethodDef zx_aio_methods[] = {
	{ "aio_uring_probe", py_aio_uring_probe, METH_NOARGS, aio_uring_probe_doc },
	{ "crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS, crc32c_doc },
	{ NULL, NULL, 0, NULL },
};
