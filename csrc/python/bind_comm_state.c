/* bind_comm_state.c - zero_ext._C's fragment routines (comm.h, comm_state.c): one parameter's
 * fragments across ranks, for zero_ext/comm/fragments.py (the state routines' data path).
 *
 * Tensors arrive as addresses of fp32 buffers; fragments.py checks dtype, size and contiguity and
 * keeps them alive for the call. The gather waits on the other ranks, so it runs without the GIL.
 */
#include "bindings.h"

#include <errno.h>

#include "comm.h"


static PyObject *py_frag_map(PyObject *self, PyObject *args)
{
	int layout, world;
	long long numel, offset, part;
	if (!PyArg_ParseTuple(args, "iLLLi:frag_map", &layout, &numel, &offset, &part, &world))
		return NULL;
	if (world < 1 || world > ZX_COMM_MAX_WORLD)
		return zx_raise(-EINVAL, "frag_map: world");
	int64_t counts[world], param_at[world], part_at[world];
	int rc = zx_frag_map(layout, numel, offset, part, world, counts, param_at, part_at);
	if (rc < 0)
		return zx_raise(rc, "frag_map");
	PyObject *a = zx_int64_list(counts, world), *b = a ? zx_int64_list(param_at, world) : NULL;
	PyObject *c = b ? zx_int64_list(part_at, world) : NULL;
	PyObject *result = c ? PyTuple_Pack(3, a, b, c) : NULL;
	Py_XDECREF(a);
	Py_XDECREF(b);
	Py_XDECREF(c);
	return result;
}

/* frag_gather(comm or None, layout, numel, offset, part, partition, out, divisor) */
static PyObject *py_frag_gather(PyObject *self, PyObject *args)
{
	PyObject *comm_obj;
	int layout;
	long long numel, offset, part;
	unsigned long long partition, out;
	float divisor;
	if (!PyArg_ParseTuple(args, "OiLLLKKf:frag_gather", &comm_obj, &layout, &numel, &offset, &part,
			      &partition, &out, &divisor))
		return NULL;
	struct zx_comm *comm = NULL;
	if (comm_obj != Py_None && !(comm = zx_comm_of(comm_obj)))
		return NULL;
	char msg[ZX_COMM_ERROR_BYTES];
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_frag_gather(comm, layout, numel, offset, part, PTR(partition), PTR(out), divisor, msg,
			    sizeof(msg));
	Py_END_ALLOW_THREADS
	if (rc < 0)
		return msg[0] ? zx_comm_raise(rc, msg) : zx_raise(rc, "frag_gather");
	Py_RETURN_NONE;
}

static PyObject *py_frag_scatter(PyObject *self, PyObject *args)
{
	int layout, world, rank;
	long long numel, offset, part;
	unsigned long long full, partition;
	float factor;
	if (!PyArg_ParseTuple(args, "iLLLiiKKf:frag_scatter", &layout, &numel, &offset, &part, &world, &rank,
			      &full, &partition, &factor))
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_frag_scatter(layout, numel, offset, part, world, rank, PTR(full), PTR(partition), factor);
	Py_END_ALLOW_THREADS
	return rc < 0 ? zx_raise(rc, "frag_scatter") : Py_NewRef(Py_None);
}

static PyObject *py_frag_copy(PyObject *self, PyObject *args)
{
	unsigned long long src, dst;
	long long count;
	int mode;
	float factor;
	if (!PyArg_ParseTuple(args, "KKLif:frag_copy", &src, &dst, &count, &mode, &factor))
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_frag_copy(PTR(src), PTR(dst), count, mode, factor);
	Py_END_ALLOW_THREADS
	return rc < 0 ? zx_raise(rc, "frag_copy") : Py_NewRef(Py_None);
}

PyMethodDef zx_frag_methods[] = {
	{ "frag_map", py_frag_map, METH_VARARGS,
	  "frag_map(layout, numel, offset, part, world) -> (counts, param_at, part_at): each rank's "
	  "fragment of one parameter (layout 0: flat stages 0-2, 1: stage-3 shards)" },
	{ "frag_gather", py_frag_gather, METH_VARARGS,
	  "frag_gather(comm|None, layout, numel, offset, part, partition, out, divisor): the full fp32 "
	  "parameter from every rank's fragment (collective, blocking), divided by divisor" },
	{ "frag_scatter", py_frag_scatter, METH_VARARGS,
	  "frag_scatter(layout, numel, offset, part, world, rank, full, partition, factor): this rank's "
	  "run of a full fp32 value, times factor, into its fragment" },
	{ "frag_copy", py_frag_copy, METH_VARARGS,
	  "frag_copy(src, dst, count, mode, factor): dst = src (mode 0), src / factor (1), src * factor (2)" },
	{ NULL, NULL, 0, NULL },
};
