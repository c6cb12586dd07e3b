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

PyMethodDef zx_quant_methods[] = {
	{ "quant_sizes", py_quant_sizes, METH_VARARGS,
	  "quant_sizes(format, n, block) -> (data_bytes, blocks) of n elements in format (0 int8, 1 int4)" },
	{ "quantize", py_quantize, METH_VARARGS,
	  "quantize(format, dtype, src, n, block, q, scales, isa): block quantization (quant.h) on addresses "
	  "(isa -1: the best, 0: the scalar reference)" },
	{ "dequantize", py_dequantize, METH_VARARGS,
	  "dequantize(format, q, scales, n, block, dtype, dst, accumulate, isa): q * s into dst (added to an "
	  "fp32 dst with accumulate)" },
	{ NULL, NULL, 0, NULL },
};
