/* module.c - zero_ext._C: the module, and what its binding units share. csrc/python/ is the Python
 * face of the C core and the only code that includes Python.h (one bind_*.c per C unit).
 *
 * The C core takes raw pointers and element counts; the bindings turn Python arguments into them and C
 * status codes (0 or -errno) into exceptions. Tensors never reach here as objects: the Python layer
 * checks dtype, device, contiguity and alignment and passes tensor.data_ptr() and numel (see
 * docs/design.md, "How tensors cross into C"). Work longer than microseconds runs with the GIL
 * released, and memory touched without the GIL is never allocated with PyMem_Malloc.
 */
#include "bindings.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------------
 * Errors: the one translator from C status to Python exception */

/* Raises for a negative C status and returns NULL, so call sites read `return zx_raise(rc, "...")`. */
PyObject *zx_raise(int64_t status, const char *what)
{
	int err = (int)-status;
	switch (err) {
	case ENOMEM:
		return PyErr_NoMemory();
	case EINVAL:
		PyErr_Format(PyExc_ValueError, "%s: invalid argument", what);
		return NULL;
	case EOVERFLOW:
		PyErr_Format(PyExc_OverflowError, "%s: element counts overflow 2^62", what);
		return NULL;
	default:
		errno = err;
		PyErr_SetFromErrno(PyExc_OSError);
		return NULL;
	}
}

/* ---------------------------------------------------------------------------------------------------
 * Argument helpers */

/* A Python sequence of ints as a fresh int64 array (free with PyMem_Free); *n receives its length. */
int64_t *zx_int64_array(PyObject *seq, Py_ssize_t *n, const char *name)
{
	PyObject *fast = PySequence_Fast(seq, name);
	if (!fast)
		return NULL;
	Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
	int64_t *out = PyMem_Malloc((size_t)(len > 0 ? len : 1) * sizeof(int64_t));
	if (!out) {
		Py_DECREF(fast);
		PyErr_NoMemory();
		return NULL;
	}
	PyObject **items = PySequence_Fast_ITEMS(fast);
	for (Py_ssize_t i = 0; i < len; i++) {
		long long v = PyLong_AsLongLong(items[i]);
		if (v == -1 && PyErr_Occurred()) {
			PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int", name, i);
			PyMem_Free(out);
			Py_DECREF(fast);
			return NULL;
		}
		out[i] = v;
	}
	Py_DECREF(fast);
	*n = len;
	return out;
}

PyObject *zx_int64_list(const int64_t *v, int64_t n)
{
	PyObject *list = PyList_New((Py_ssize_t)n);
	for (int64_t i = 0; list && i < n; i++) {
		PyObject *item = PyLong_FromLongLong(v[i]);
		if (!item) {
			Py_CLEAR(list);
			break;
		}
		PyList_SET_ITEM(list, (Py_ssize_t)i, item);
	}
	return list;
}

/* ---------------------------------------------------------------------------------------------------
 * The module: each binding unit's functions, then its types */

static int zx_exec(PyObject *module)
{
	PyMethodDef *tables[] = { zx_planner_methods, zx_optim_methods, zx_aio_methods, zx_comm_methods,
				  zx_quant_methods, zx_frag_methods };
	for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++)
		if (PyModule_AddFunctions(module, tables[i]) < 0)
			return -1;
	return zx_aio_exec(module) < 0 ? -1 : zx_comm_exec(module);
}

static PyModuleDef_Slot zx_slots[] = {
	{ Py_mod_exec, zx_exec },
#if PY_VERSION_HEX >= 0x030C0000
	/* The C core keeps no per-interpreter state, but NCCL communicators (the CUDA library) are per
	 * process, so sub-interpreters are not supported. */
	{ Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED },
#endif
	{ 0, NULL },
};

static struct PyModuleDef zx_module = {
	PyModuleDef_HEAD_INIT,
	.m_name = "zero_ext._C",
	.m_doc = "zero_ext's C core: partition planner, SIMD dispatch, CPU optimizers, NVMe I/O, collectives.",
	.m_size = 0,
	.m_slots = zx_slots,
};

PyMODINIT_FUNC PyInit__C(void)
{
	return PyModuleDef_Init(&zx_module);
}
