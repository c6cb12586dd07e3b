/* bind_quant.c - zero_ext._C's block quantization (quant.h) on addresses; zero_ext/ops/quantize.py
 * checks the tensors and sizes the outputs. The kernels run without the GIL. */
#include "bindings.h"

#include "quant.h"


static PyObject *py_quant_sizes(PyObject *self, PyObject *args)
{
	int format;
	long long n, block;
	if (!PyArg_ParseTuple(args, "iLL:quant_sizes", &format, &n, &block))
		return NULL;
	int64_t blocks = zx_quant_blocks(format, n, block);
	if (blocks < 0)
		return zx_raise(blocks, "quant_sizes");
	return Py_BuildValue("(LL)", (long long)zx_quant_data_bytes(format, n), (long long)blocks);
}

static PyObject *py_quantize(PyObject *self, PyObject *args)
{
	int format, dtype, isa;
	unsigned long long src, q, scales;
	long long n, block;
	if (!PyArg_ParseTuple(args, "iiKLLKKi:quantize", &format, &dtype, &src, &n, &block, &q, &scales, &isa))
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_quantize(format, dtype, PTR(src), n, block, PTR(q), PTR(scales), isa);
	Py_END_ALLOW_THREADS
	return rc < 0 ? zx_raise(rc, "quantize") : Py_NewRef(Py_None);
}

static PyObject *py_dequantize(PyObject *self, PyObject *args)
{
	int format, dtype, accumulate, isa;
	unsigned long long q, scales, dst;
	long long n, block;
	if (!PyArg_ParseTuple(args, "iKKLLiKpi:dequantize", &format, &q, &scales, &n, &block, &dtype, &dst,
			      &accumulate, &isa))
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_dequantize(format, PTR(q), PTR(scales), n, block, dtype, PTR(dst), accumulate, isa);
	Py_END_ALLOW_THREADS
	return rc < 0 ? zx_raise(rc, "dequantize") : Py_NewRef(Py_None);
}

/* items: a flat sequence of 6 integers per item: src, dst, scales, n, format, dtype (quant.h). */
static struct zx_quant_item *parse_items(PyObject *seq, Py_ssize_t *count)
{
	Py_ssize_t n = 0;
	int64_t *v = zx_int64_array(seq, &n, "items");
	if (!v)
		return NULL;
	if (n % 6) {
		PyMem_Free(v);
		PyErr_SetString(PyExc_ValueError, "items: 6 integers per item (src, dst, scales, n, format, dtype)");
		return NULL;
	}
	struct zx_quant_item *items = PyMem_Malloc((size_t)(n / 6 + 1) * sizeof(*items));
	if (!items) {
		PyMem_Free(v);
		PyErr_NoMemory();
		return NULL;
	}
	for (Py_ssize_t i = 0; i < n / 6; i++) {
		const int64_t *f = v + 6 * i;
		items[i] = (struct zx_quant_item){ PTR(f[0]), PTR(f[1]), PTR(f[2]), f[3], (int32_t)f[4], (int32_t)f[5] };
	}
	PyMem_Free(v);
	*count = n / 6;
	return items;
}

static PyObject *py_quantize_batch(PyObject *self, PyObject *args)
{
	PyObject *seq;
	long long block;
	int isa;
	if (!PyArg_ParseTuple(args, "OLi:quantize_batch", &seq, &block, &isa))
		return NULL;
	Py_ssize_t n = 0;
	struct zx_quant_item *items = parse_items(seq, &n);
	if (!items)
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_quantize_batch(items, n, block, isa);
	Py_END_ALLOW_THREADS
	PyMem_Free(items);
	return rc < 0 ? zx_raise(rc, "quantize_batch") : Py_NewRef(Py_None);
}

static PyObject *py_dequantize_batch(PyObject *self, PyObject *args)
{
	PyObject *seq;
	long long group, block;
	int accumulate, isa;
	if (!PyArg_ParseTuple(args, "OLLpi:dequantize_batch", &seq, &group, &block, &accumulate, &isa))
		return NULL;
	Py_ssize_t n = 0;
	struct zx_quant_item *items = parse_items(seq, &n);
	if (!items)
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_dequantize_batch(items, n, group, block, accumulate, isa);
	Py_END_ALLOW_THREADS
	PyMem_Free(items);
	return rc < 0 ? zx_raise(rc, "dequantize_batch") : Py_NewRef(Py_None);
}

static PyObject *py_requantize_batch(PyObject *self, PyObject *args)
{
	PyObject *seq, *out_seq;
	long long group, block;
	int isa;
	if (!PyArg_ParseTuple(args, "OLOLi:requantize_batch", &seq, &group, &out_seq, &block, &isa))
		return NULL;
	Py_ssize_t n = 0, nout = 0;
	struct zx_quant_item *items = parse_items(seq, &n), *outs = items ? parse_items(out_seq, &nout) : NULL;
	if (!outs) {
		PyMem_Free(items);
		return NULL;
	}
	int rc = -EINVAL;
	if (group > 0 && n == nout * group) {
		Py_BEGIN_ALLOW_THREADS
		rc = zx_requantize_batch(items, n, group, outs, block, isa);
		Py_END_ALLOW_THREADS
	}
	PyMem_Free(items);
	PyMem_Free(outs);
	return rc < 0 ? zx_raise(rc, "requantize_batch") : Py_NewRef(Py_None);
}

PyMethodDef zx_quant_methods[] = {
	{ "quant_sizes", py_quant_sizes, METH_VARARGS,
	  "quant_sizes(format, n, block) -> (data_bytes, blocks) of n elements in format (0 int8, 1 int4)" },
	{ "quantize", py_quantize, METH_VARARGS,
	  "quantize(format, dtype, src, n, block, q, scales, isa): block quantization (quant.h) on addresses "
	  "(isa -1: the best, 0: the scalar reference)" },
	{ "dequantize", py_dequantize, METH_VARARGS,
	  "dequantize(format, q, scales, n, block, dtype, dst, accumulate, isa): q * s into dst (added to an "
	  "fp32 dst with accumulate)" },
	{ "quantize_batch", py_quantize_batch, METH_VARARGS,
	  "quantize_batch(items, block, isa): many quantizations (raw items copied) in one call; items: 6 "
	  "integers each (src, dst, scales, n, format, dtype)" },
	{ "dequantize_batch", py_dequantize_batch, METH_VARARGS,
	  "dequantize_batch(items, group, block, accumulate, isa): many dequantizations in one call; with "
	  "accumulate each group of items adds into one fp32 dst in item order" },
	{ "requantize_batch", py_requantize_batch, METH_VARARGS,
	  "requantize_batch(items, group, outs, block, isa): each group of items summed in fp32 in item order "
	  "and quantized into its out item (raw: stored as fp32); items and outs as in quantize_batch" },
	{ NULL, NULL, 0, NULL },
};
