/* bind_optim.c - zero_ext._C's CPU optimizers (cpu_adam.h) and the bandwidth floor (membw.h). */
#include "bindings.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_adam.h"
#include "membw.h"

/* ---------------------------------------------------------------------------------------------------
 * CPU optimizers (cpu_adam.h, membw.h) */

/* The tensors of an optimizer call from parallel Python sequences of data_ptr() ints (0 or None
 * for absent) and one of numels, in memory the step reads without the
 * GIL (PyMem_RawCalloc). Free with PyMem_RawFree. */
static zx_optim_tensor *optim_tensors(PyObject *params, PyObject *grads, PyObject *exp_avgs,
				      PyObject *exp_avg_sqs, PyObject *outs, PyObject *numels,
				      Py_ssize_t *count)
{
	PyObject *seqs[5] = { params, grads, exp_avgs, exp_avg_sqs, outs };
	static const char *names[5] = { "params", "grads", "exp_avgs", "exp_avg_sqs", "outs" };
	int64_t *ptr[5] = { NULL };
	zx_optim_tensor *t = NULL;
	Py_ssize_t n;
	int64_t *numel = zx_int64_array(numels, &n, "numels");
	if (!numel)
		return NULL;
	for (int k = 0; k < 5; k++) {
		if (seqs[k] == Py_None)
			continue;
		Py_ssize_t len;
		ptr[k] = zx_int64_array(seqs[k], &len, names[k]);
		if (!ptr[k])
			goto done;
		if (len != n) {
			PyErr_Format(PyExc_ValueError, "%s has %zd entries but numels has %zd", names[k],
				     len, n);
			goto done;
		}
	}
	t = PyMem_RawCalloc((size_t)(n > 0 ? n : 1), sizeof(zx_optim_tensor));
	if (!t) {
		PyErr_NoMemory();
		goto done;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		t[i].param = ptr[0] ? (float *)(uintptr_t)ptr[0][i] : NULL;
		t[i].grad = ptr[1] ? (const float *)(uintptr_t)ptr[1][i] : NULL;
		t[i].exp_avg = ptr[2] ? (float *)(uintptr_t)ptr[2][i] : NULL;
		t[i].exp_avg_sq = ptr[3] ? (float *)(uintptr_t)ptr[3][i] : NULL;
		t[i].out = ptr[4] ? (void *)(uintptr_t)ptr[4][i] : NULL;
		t[i].numel = numel[i];
	}
	*count = n;
done:
	for (int k = 0; k < 5; k++)
		PyMem_Free(ptr[k]);
	PyMem_Free(numel);
	return t;
}

/* The kernels of this file as one signature, so that one function runs them all. */
typedef int (*optim_kernel)(const void *cfg, const zx_optim_tensor *t, int64_t n, int out_dtype,
			    int isa);

static int adam_kernel(const void *cfg, const zx_optim_tensor *t, int64_t n, int odt, int isa)
{
	return zx_adam_step(cfg, t, n, odt, isa);
}

static int adagrad_kernel(const void *cfg, const zx_optim_tensor *t, int64_t n, int odt, int isa)
{
	return zx_adagrad_step(cfg, t, n, odt, isa);
}

static int lion_kernel(const void *cfg, const zx_optim_tensor *t, int64_t n, int odt, int isa)
{
	return zx_lion_step(cfg, t, n, odt, isa);
}

static int membw_kernel(const void *cfg, const zx_optim_tensor *t, int64_t n, int odt, int isa)
{
	return zx_membw_adam(t, n, odt, isa);
}

/* What every optimizer binding does once its arguments are parsed: the tensors from their
 * sequences (as optim_tensors), kernel(cfg, ...) on them without the GIL, its status as an
 * exception named `name`. */
static PyObject *optim_call(const char *name, optim_kernel kernel, const void *cfg,
			    PyObject *params, PyObject *grads, PyObject *exp_avgs,
			    PyObject *exp_avg_sqs, PyObject *outs, PyObject *numels, int out_dtype,
			    int isa)
{
	Py_ssize_t n = 0;
	zx_optim_tensor *t = optim_tensors(params, grads, exp_avgs, exp_avg_sqs, outs, numels, &n);
	if (!t)
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = kernel(cfg, t, n, out_dtype, isa);
	Py_END_ALLOW_THREADS
	PyMem_RawFree(t);
	if (rc)
		return zx_raise(rc, name);
	Py_RETURN_NONE;
}

PyDoc_STRVAR(cpu_optim_set_threads_doc,
	     "cpu_optim_set_threads(n)\n\n"
	     "Threads of the CPU optimizer kernels (their own pthread pool, not OpenMP), 1..256.");

static PyObject *py_cpu_optim_set_threads(PyObject *self, PyObject *args)
{
	int n;
	if (!PyArg_ParseTuple(args, "i:cpu_optim_set_threads", &n))
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS /* waits for a running step, and joins the old workers */
	rc = zx_optim_set_threads(n);
	Py_END_ALLOW_THREADS
	if (rc)
		return zx_raise(rc, "cpu_optim_set_threads");
	Py_RETURN_NONE;
}

PyDoc_STRVAR(cpu_optim_threads_doc,
	     "cpu_optim_threads() -> threads the CPU optimizer kernels use (default: this process's "
	     "CPUs)");

static PyObject *py_cpu_optim_threads(PyObject *self, PyObject *unused)
{
	return PyLong_FromLong(zx_optim_threads());
}

PyDoc_STRVAR(adam_step_doc,
	     "adam_step(params, grads, exp_avgs, exp_avg_sqs, outs, numels, out_dtype, lr, beta1,\n"
	     "          beta2, eps, weight_decay, step, bias_correction, adamw_mode, grad_scale,\n"
	     "          isa=-1)\n\n"
	     "One Adam/AdamW step over many fp32 tensors in one pass, GIL released. The first five\n"
	     "are sequences of data_ptr() ints (outs may be None, or hold 0 for no bf16/fp16 copy),\n"
	     "numels their sizes, out_dtype the zx dtype code of the copies. Gradients are multiplied\n"
	     "by grad_scale as they are loaded. isa: -1 for the default path, else 0 scalar, 1 avx2,\n"
	     "2 avx512.");

static PyObject *py_adam_step(PyObject *self, PyObject *args)
{
	PyObject *params, *grads, *m, *v, *outs, *numels;
	zx_adam_config cfg;
	long long step;
	int out_dtype, bias_correction, adamw_mode, isa = -1;
	if (!PyArg_ParseTuple(args, "OOOOOOidddddLppd|i:adam_step", &params, &grads, &m, &v, &outs,
			      &numels, &out_dtype, &cfg.lr, &cfg.beta1, &cfg.beta2, &cfg.eps,
			      &cfg.weight_decay, &step, &bias_correction, &adamw_mode,
			      &cfg.grad_scale, &isa))
		return NULL;
	cfg.step = step;
	cfg.bias_correction = bias_correction;
	cfg.adamw_mode = adamw_mode;
	return optim_call("adam_step", adam_kernel, &cfg, params, grads, m, v, outs, numels, out_dtype,
			  isa);
}

PyDoc_STRVAR(adagrad_step_doc,
	     "adagrad_step(params, grads, sums, outs, numels, out_dtype, lr, eps, weight_decay,\n"
	     "             grad_scale, isa=-1)\n\n"
	     "One Adagrad step over many fp32 tensors (sums: the sum of squares), as adam_step.");

static PyObject *py_adagrad_step(PyObject *self, PyObject *args)
{
	PyObject *params, *grads, *sums, *outs, *numels;
	zx_adagrad_config cfg;
	int out_dtype, isa = -1;
	if (!PyArg_ParseTuple(args, "OOOOOidddd|i:adagrad_step", &params, &grads, &sums, &outs,
			      &numels, &out_dtype, &cfg.lr, &cfg.eps, &cfg.weight_decay,
			      &cfg.grad_scale, &isa))
		return NULL;
	return optim_call("adagrad_step", adagrad_kernel, &cfg, params, grads, Py_None, sums, outs,
			  numels, out_dtype, isa);
}

PyDoc_STRVAR(lion_step_doc,
	     "lion_step(params, grads, exp_avgs, outs, numels, out_dtype, lr, beta1, beta2,\n"
	     "          weight_decay, grad_scale, isa=-1)\n\n"
	     "One Lion step over many fp32 tensors, as adam_step.");

static PyObject *py_lion_step(PyObject *self, PyObject *args)
{
	PyObject *params, *grads, *m, *outs, *numels;
	zx_lion_config cfg;
	int out_dtype, isa = -1;
	if (!PyArg_ParseTuple(args, "OOOOOiddddd|i:lion_step", &params, &grads, &m, &outs, &numels,
			      &out_dtype, &cfg.lr, &cfg.beta1, &cfg.beta2, &cfg.weight_decay,
			      &cfg.grad_scale, &isa))
		return NULL;
	return optim_call("lion_step", lion_kernel, &cfg, params, grads, m, Py_None, outs, numels,
			  out_dtype, isa);
}

PyDoc_STRVAR(grad_sqnorm_doc,
	     "grad_sqnorm(dst, src, src_dtype, n, isa=-1) -> float\n\n"
	     "Sum of squares (in double) of n gradient values at src (fp32, bf16 or fp16), copying\n"
	     "them as fp32 to dst in the same pass unless dst is 0. GIL released.");

static PyObject *py_grad_sqnorm(PyObject *self, PyObject *args)
{
	unsigned long long dst, src;
	int dtype, isa = -1;
	long long n;
	if (!PyArg_ParseTuple(args, "KKiL|i:grad_sqnorm", &dst, &src, &dtype, &n, &isa))
		return NULL;
	double sum = 0.0;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_grad_sqnorm((float *)(uintptr_t)dst, (const void *)(uintptr_t)src, dtype, n, isa,
			    &sum);
	Py_END_ALLOW_THREADS
	if (rc)
		return zx_raise(rc, "grad_sqnorm");
	return PyFloat_FromDouble(sum);
}

PyDoc_STRVAR(cast_f32_doc,
	     "cast_f32(dst, dst_dtype, src, n, isa=-1)\n\n"
	     "dst (bf16 or fp16) = src (fp32), n elements, rounded to nearest even as torch's .to().");

static PyObject *py_cast_f32(PyObject *self, PyObject *args)
{
	unsigned long long dst, src;
	int dtype, isa = -1;
	long long n;
	if (!PyArg_ParseTuple(args, "KiKL|i:cast_f32", &dst, &dtype, &src, &n, &isa))
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_cast_f32((void *)(uintptr_t)dst, dtype, (const float *)(uintptr_t)src, n, isa);
	Py_END_ALLOW_THREADS
	if (rc)
		return zx_raise(rc, "cast_f32");
	Py_RETURN_NONE;
}

PyDoc_STRVAR(membw_adam_doc,
	     "membw_adam(params, grads, exp_avgs, exp_avg_sqs, outs, numels, out_dtype, isa=-1)\n\n"
	     "Benchmark floor: moves exactly Adam's bytes with trivial arithmetic (p, m, v += g),\n"
	     "same tiles and threads as adam_step. Overwrites its arguments.");

static PyObject *py_membw_adam(PyObject *self, PyObject *args)
{
	PyObject *params, *grads, *m, *v, *outs, *numels;
	int out_dtype, isa = -1;
	if (!PyArg_ParseTuple(args, "OOOOOOi|i:membw_adam", &params, &grads, &m, &v, &outs, &numels,
			      &out_dtype, &isa))
		return NULL;
	return optim_call("membw_adam", membw_kernel, NULL, params, grads, m, v, outs, numels,
			  out_dtype, isa);
}

PyMethodDef zx_optim_methods[] = {
	{ "cpu_optim_set_threads", py_cpu_optim_set_threads, METH_VARARGS, cpu_optim_set_threads_doc },
	{ "cpu_optim_threads", py_cpu_optim_threads, METH_NOARGS, cpu_optim_threads_doc },
	{ "adam_step", py_adam_step, METH_VARARGS, adam_step_doc },
	{ "adagrad_step", py_adagrad_step, METH_VARARGS, adagrad_step_doc },
	{ "lion_step", py_lion_step, METH_VARARGS, lion_step_doc },
	{ "grad_sqnorm", py_grad_sqnorm, METH_VARARGS, grad_sqnorm_doc },
	{ "cast_f32", py_cast_f32, METH_VARARGS, cast_f32_doc },
	{ "membw_adam", py_membw_adam, METH_VARARGS, membw_adam_doc },
	{ NULL, NULL, 0, NULL },
};
