/* module.c - zero_ext._C: the Python face of the C core. The only file that includes Python.h.
 *
 * The C core takes raw pointers and element counts; this file turns Python arguments into them and C
 * status codes (0 or -errno) into exceptions. Tensors never reach here as objects: the Python layer
 * checks dtype, device, contiguity and alignment and passes tensor.data_ptr() and numel (see
 * docs/design.md, "How tensors cross into C"). Work longer than microseconds runs with the GIL
 * released, and memory touched without the GIL is never allocated with PyMem_Malloc.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_features.h"
#include "partition.h"
#include "cpu_adam.h"
#include "membw.h"
#include "aio.h"

/* ---------------------------------------------------------------------------------------------------
 * Errors: the one translator from C status to Python exception */

/* Raises for a negative C status and returns NULL, so call sites read `return zx_raise(rc, "...")`. */
static PyObject *zx_raise(int64_t status, const char *what)
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
static int64_t *int64_array(PyObject *seq, Py_ssize_t *n, const char *name)
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

static PyObject *int64_list(const int64_t *v, int64_t n)
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

/* Pieces as a list of 6-tuples (param, rank, param_offset, part_offset, bucket_offset, length). */
static PyObject *piece_list(const zx_piece *p, int64_t n)
{
	PyObject *list = PyList_New((Py_ssize_t)n);
	for (int64_t i = 0; list && i < n; i++) {
		PyObject *t = Py_BuildValue("(LLLLLL)", (long long)p[i].param, (long long)p[i].rank,
					    (long long)p[i].param_offset, (long long)p[i].part_offset,
					    (long long)p[i].bucket_offset, (long long)p[i].length);
		if (!t) {
			Py_CLEAR(list);
			break;
		}
		PyList_SET_ITEM(list, (Py_ssize_t)i, t);
	}
	return list;
}

/* Runs a piece producer twice: once to count, once to fill an array of exactly that size. The call
 * names `out` and `cap`, which the macro declares; the result lands in the caller's `result`. */
#define ZX_PIECES(call_with_out_cap, what)                                                          \
	do {                                                                                        \
		zx_piece *out = NULL;                                                               \
		int64_t cap = 0;                                                                    \
		int64_t zx_total_ = (call_with_out_cap);                                            \
		if (zx_total_ >= 0) {                                                               \
			out = PyMem_Malloc((size_t)(zx_total_ > 0 ? zx_total_ : 1) * sizeof(zx_piece)); \
			if (!out) {                                                                 \
				result = PyErr_NoMemory();                                          \
				break;                                                              \
			}                                                                           \
			cap = zx_total_;                                                            \
			zx_total_ = (call_with_out_cap);                                            \
		}                                                                                   \
		result = zx_total_ < 0 ? zx_raise(zx_total_, what) : piece_list(out, zx_total_);    \
		PyMem_Free(out);                                                                    \
	} while (0)

/* ---------------------------------------------------------------------------------------------------
 * Partition planner (partition.h) */

PyDoc_STRVAR(flat_layout_doc,
	     "flat_layout(numels, world, align) -> (padded, offsets)\n\n"
	     "Stage 1/2 flat buffer of one param group: its padded length (a multiple of align*world)\n"
	     "and the start offset of each parameter.");

static PyObject *py_flat_layout(PyObject *self, PyObject *args)
{
	PyObject *seq, *result = NULL;
	long long world, align;
	if (!PyArg_ParseTuple(args, "OLL:flat_layout", &seq, &world, &align))
		return NULL;
	Py_ssize_t n;
	int64_t *numel = int64_array(seq, &n, "numels");
	if (!numel)
		return NULL;
	int64_t *offset = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
	if (!offset) {
		PyMem_Free(numel);
		return PyErr_NoMemory();
	}
	int64_t padded = zx_flat_layout(numel, n, world, align, offset);
	if (padded < 0) {
		zx_raise(padded, "flat_layout");
	} else {
		PyObject *offsets = int64_list(offset, n);
		if (offsets)
			result = Py_BuildValue("(LN)", (long long)padded, offsets);
	}
	PyMem_Free(numel);
	PyMem_Free(offset);
	return result;
}

PyDoc_STRVAR(flat_fragments_doc,
	     "flat_fragments(numels, world, align, rank) -> [(param, rank, param_offset, part_offset,\n"
	     "-1, length)]\n\nThe pieces of each parameter in the stage 1/2 partition of `rank`.");

static PyObject *py_flat_fragments(PyObject *self, PyObject *args)
{
	PyObject *seq, *result = NULL;
	long long world, align, rank;
	if (!PyArg_ParseTuple(args, "OLLL:flat_fragments", &seq, &world, &align, &rank))
		return NULL;
	Py_ssize_t n;
	int64_t *numel = int64_array(seq, &n, "numels");
	if (!numel)
		return NULL;
	ZX_PIECES(zx_flat_fragments(numel, n, world, align, rank, out, cap), "flat_fragments");
	PyMem_Free(numel);
	return result;
}

PyDoc_STRVAR(flat_bucket_pieces_doc,
	     "flat_bucket_pieces(numels, world, align, order) -> [(param, rank, param_offset,\n"
	     "part_offset, bucket_offset, length)]\n\n"
	     "Owners of each run of a stage 1/2 bucket holding parameters `order` back to back.");

static PyObject *py_flat_bucket_pieces(PyObject *self, PyObject *args)
{
	PyObject *seq, *oseq, *result = NULL;
	long long world, align;
	if (!PyArg_ParseTuple(args, "OLLO:flat_bucket_pieces", &seq, &world, &align, &oseq))
		return NULL;
	Py_ssize_t n, count = 0;
	int64_t *numel = int64_array(seq, &n, "numels");
	if (!numel)
		return NULL;
	int64_t *order = int64_array(oseq, &count, "order");
	if (order) {
		ZX_PIECES(zx_flat_bucket_pieces(numel, n, world, align, order, count, out, cap),
			  "flat_bucket_pieces");
		PyMem_Free(order);
	}
	PyMem_Free(numel);
	return result;
}

PyDoc_STRVAR(allgather_chunk_doc,
	     "allgather_chunk(partition, world, align, bucket) -> int\n\n"
	     "Elements of each rank's partition gathered per all-gather call under `bucket`.");

static PyObject *py_allgather_chunk(PyObject *self, PyObject *args)
{
	long long partition, world, align, bucket;
	if (!PyArg_ParseTuple(args, "LLLL:allgather_chunk", &partition, &world, &align, &bucket))
		return NULL;
	int64_t chunk = zx_allgather_chunk(partition, world, align, bucket);
	return chunk < 0 ? zx_raise(chunk, "allgather_chunk") : PyLong_FromLongLong(chunk);
}

PyDoc_STRVAR(shard_numel_doc, "shard_numel(numel, world) -> ceil(numel / world)");

static PyObject *py_shard_numel(PyObject *self, PyObject *args)
{
	long long numel, world;
	if (!PyArg_ParseTuple(args, "LL:shard_numel", &numel, &world))
		return NULL;
	int64_t shard = zx_shard_numel(numel, world);
	return shard < 0 ? zx_raise(shard, "shard_numel") : PyLong_FromLongLong(shard);
}

PyDoc_STRVAR(shard_valid_doc, "shard_valid(numel, world, rank) -> real elements in rank's shard");

static PyObject *py_shard_valid(PyObject *self, PyObject *args)
{
	long long numel, world, rank;
	if (!PyArg_ParseTuple(args, "LLL:shard_valid", &numel, &world, &rank))
		return NULL;
	int64_t valid = zx_shard_valid(numel, world, rank);
	return valid < 0 ? zx_raise(valid, "shard_valid") : PyLong_FromLongLong(valid);
}

PyDoc_STRVAR(sub_groups_doc,
	     "sub_groups(numels, world, sub_group_size) -> [group of each parameter]\n\n"
	     "Stage 3 optimizer sub-groups of whole parameters (DeepSpeed's boundaries).");

static PyObject *py_sub_groups(PyObject *self, PyObject *args)
{
	PyObject *seq, *result = NULL;
	long long world, size;
	if (!PyArg_ParseTuple(args, "OLL:sub_groups", &seq, &world, &size))
		return NULL;
	Py_ssize_t n;
	int64_t *numel = int64_array(seq, &n, "numels");
	if (!numel)
		return NULL;
	int64_t *group_of = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
	if (!group_of) {
		PyMem_Free(numel);
		return PyErr_NoMemory();
	}
	int64_t groups = zx_sub_groups(numel, n, world, size, group_of);
	result = groups < 0 ? zx_raise(groups, "sub_groups") : int64_list(group_of, n);
	PyMem_Free(numel);
	PyMem_Free(group_of);
	return result;
}

PyDoc_STRVAR(shard_bucket_pieces_doc,
	     "shard_bucket_pieces(numels, world, order) -> (block, [(param, rank, param_offset, 0,\n"
	     "bucket_offset, length)])\n\n"
	     "Stage 3 bucket in rank-major layout (reduce_scatter_tensor / all_gather_into_tensor).");

static PyObject *py_shard_bucket_pieces(PyObject *self, PyObject *args)
{
	PyObject *seq, *oseq, *result = NULL;
	long long world;
	if (!PyArg_ParseTuple(args, "OLO:shard_bucket_pieces", &seq, &world, &oseq))
		return NULL;
	Py_ssize_t n, count = 0;
	int64_t *numel = int64_array(seq, &n, "numels");
	if (!numel)
		return NULL;
	int64_t *order = int64_array(oseq, &count, "order");
	int64_t block = 0;
	if (order) {
		ZX_PIECES(zx_shard_bucket_pieces(numel, n, world, order, count, &block, out, cap),
			  "shard_bucket_pieces");
		PyMem_Free(order);
		if (result)
			result = Py_BuildValue("(LN)", (long long)block, result);
	}
	PyMem_Free(numel);
	return result;
}

PyDoc_STRVAR(buckets_doc,
	     "buckets(sizes, bucket_size, order=None) -> [bucket of each item, in `order`]\n\n"
	     "Consecutive buckets of at most bucket_size elements; larger items get their own.");

static PyObject *py_buckets(PyObject *self, PyObject *args)
{
	PyObject *seq, *oseq = Py_None, *result = NULL;
	long long size;
	if (!PyArg_ParseTuple(args, "OL|O:buckets", &seq, &size, &oseq))
		return NULL;
	Py_ssize_t n, count = 0;
	int64_t *sizes = int64_array(seq, &n, "sizes");
	if (!sizes)
		return NULL;
	int64_t *order = NULL;
	if (oseq != Py_None) {
		order = int64_array(oseq, &count, "order");
		if (!order)
			goto done;
		if (count != n) {
			PyErr_SetString(PyExc_ValueError, "buckets: order must list every item once");
			goto done;
		}
	}
	int64_t *bucket_of = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
	if (!bucket_of) {
		PyErr_NoMemory();
		goto done;
	}
	int64_t nb = zx_buckets(sizes, n, order, size, bucket_of);
	result = nb < 0 ? zx_raise(nb, "buckets") : int64_list(bucket_of, n);
	PyMem_Free(bucket_of);
done:
	PyMem_Free(order);
	PyMem_Free(sizes);
	return result;
}

/* ---------------------------------------------------------------------------------------------------
 * CPU features */

PyDoc_STRVAR(simd_level_doc,
	     "simd_level() -> 'avx512' | 'avx2' | 'scalar'\n\n"
	     "The SIMD path C kernels take here (capped by the ZERO_EXT_ISA environment variable).");

static PyObject *py_simd_level(PyObject *self, PyObject *unused)
{
	const char *cap = getenv("ZERO_EXT_ISA");
	if (cap && *cap && strcmp(cap, "scalar") && strcmp(cap, "avx2") && strcmp(cap, "avx512")) {
		PyErr_Format(PyExc_ValueError, "ZERO_EXT_ISA=%s is not one of avx512, avx2, scalar", cap);
		return NULL;
	}
	return PyUnicode_FromString(zx_simd_name(zx_simd_level()));
}

PyDoc_STRVAR(simd_supported_doc, "simd_supported() -> the best SIMD path this CPU supports");

static PyObject *py_simd_supported(PyObject *self, PyObject *unused)
{
	return PyUnicode_FromString(zx_simd_name(zx_simd_supported()));
}

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
	int64_t *numel = int64_array(numels, &n, "numels");
	if (!numel)
		return NULL;
	for (int k = 0; k < 5; k++) {
		if (seqs[k] == Py_None)
			continue;
		Py_ssize_t len;
		ptr[k] = int64_array(seqs[k], &len, names[k]);
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
	Py_ssize_t n = 0;
	zx_optim_tensor *t = optim_tensors(params, grads, m, v, outs, numels, &n);
	if (!t)
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_adam_step(&cfg, t, n, out_dtype, isa);
	Py_END_ALLOW_THREADS
	PyMem_RawFree(t);
	if (rc)
		return zx_raise(rc, "adam_step");
	Py_RETURN_NONE;
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
	Py_ssize_t n = 0;
	zx_optim_tensor *t = optim_tensors(params, grads, Py_None, sums, outs, numels, &n);
	if (!t)
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_adagrad_step(&cfg, t, n, out_dtype, isa);
	Py_END_ALLOW_THREADS
	PyMem_RawFree(t);
	if (rc)
		return zx_raise(rc, "adagrad_step");
	Py_RETURN_NONE;
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
	Py_ssize_t n = 0;
	zx_optim_tensor *t = optim_tensors(params, grads, m, Py_None, outs, numels, &n);
	if (!t)
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_lion_step(&cfg, t, n, out_dtype, isa);
	Py_END_ALLOW_THREADS
	PyMem_RawFree(t);
	if (rc)
		return zx_raise(rc, "lion_step");
	Py_RETURN_NONE;
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
	Py_ssize_t n = 0;
	zx_optim_tensor *t = optim_tensors(params, grads, m, v, outs, numels, &n);
	if (!t)
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS
	rc = zx_membw_adam(t, n, out_dtype, isa);
	Py_END_ALLOW_THREADS
	PyMem_RawFree(t);
	if (rc)
		return zx_raise(rc, "membw_adam");
	Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------------
 * NVMe I/O (aio.h) */

/* _C.AioHandle: a struct zx_aio as a Python object (a heap type, so dealloc releases the workers).
 * The ops read and write memory that Python objects own (tensors), so each op holds a reference to
 * its `owner` until it is waited for, and close() and dealloc wait for every op in flight before
 * they let the owners go. No Py_TPFLAGS_BASETYPE: zero_ext/aio.py wraps it rather than subclassing. */
typedef struct {
	PyObject_HEAD
	struct zx_aio *aio; /* NULL once closed */
	PyObject *owners;   /* dict: op id -> object kept alive until the op is waited for */
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
	long long id = PyLong_AsLongLong(arg);
	if (id == -1 && PyErr_Occurred())
		return NULL;
	struct zx_aio *aio = aio_live(self);
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
	long long id = PyLong_AsLongLong(arg);
	if (id == -1 && PyErr_Occurred())
		return NULL;
	struct zx_aio *aio = aio_live(self);
	if (!aio)
		return NULL;
	int rc = zx_aio_done(aio, id);
	if (rc < 0) {
		PyErr_Format(PyExc_ValueError, "AioHandle.done: op %lld is not pending", id);
		return NULL;
	}
	return PyBool_FromLong(rc);
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
	{ "close", aio_close, METH_NOARGS, aio_close_doc },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef aio_getset[] = {
	{ "backend", aio_get_backend, NULL, "'uring' or 'threads' (None once closed)", NULL },
	{ "closed", aio_get_closed, NULL, "whether close() has run", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

PyDoc_STRVAR(aio_handle_doc,
	     "AioHandle(block_size=1048576, queue_depth=8, threads=1, single_submit=False,\n"
	     "          overlap_events=True, backend='auto')\n\n"
	     "Asynchronous file I/O over io_uring, or a pread/pwrite thread pool (backend 'threads',\n"
	     "or 'auto' where the kernel refuses io_uring). The aio config section's settings;\n"
	     "threads is intra_op_parallelism. Use zero_ext.aio.AsyncIO, which checks tensors and\n"
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
static int aio_exec(PyObject *module)
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
 * The module */

static PyMethodDef zx_methods[] = {
	{ "flat_layout", py_flat_layout, METH_VARARGS, flat_layout_doc },
	{ "flat_fragments", py_flat_fragments, METH_VARARGS, flat_fragments_doc },
	{ "flat_bucket_pieces", py_flat_bucket_pieces, METH_VARARGS, flat_bucket_pieces_doc },
	{ "allgather_chunk", py_allgather_chunk, METH_VARARGS, allgather_chunk_doc },
	{ "shard_numel", py_shard_numel, METH_VARARGS, shard_numel_doc },
	{ "shard_valid", py_shard_valid, METH_VARARGS, shard_valid_doc },
	{ "sub_groups", py_sub_groups, METH_VARARGS, sub_groups_doc },
	{ "shard_bucket_pieces", py_shard_bucket_pieces, METH_VARARGS, shard_bucket_pieces_doc },
	{ "buckets", py_buckets, METH_VARARGS, buckets_doc },
	{ "simd_level", py_simd_level, METH_NOARGS, simd_level_doc },
	{ "simd_supported", py_simd_supported, METH_NOARGS, simd_supported_doc },
	{ "cpu_optim_set_threads", py_cpu_optim_set_threads, METH_VARARGS, cpu_optim_set_threads_doc },
	{ "cpu_optim_threads", py_cpu_optim_threads, METH_NOARGS, cpu_optim_threads_doc },
	{ "adam_step", py_adam_step, METH_VARARGS, adam_step_doc },
	{ "adagrad_step", py_adagrad_step, METH_VARARGS, adagrad_step_doc },
	{ "lion_step", py_lion_step, METH_VARARGS, lion_step_doc },
	{ "grad_sqnorm", py_grad_sqnorm, METH_VARARGS, grad_sqnorm_doc },
	{ "cast_f32", py_cast_f32, METH_VARARGS, cast_f32_doc },
	{ "membw_adam", py_membw_adam, METH_VARARGS, membw_adam_doc },
	{ "aio_uring_probe", py_aio_uring_probe, METH_NOARGS, aio_uring_probe_doc },
	{ NULL, NULL, 0, NULL },
};

static PyModuleDef_Slot zx_slots[] = {
	{ Py_mod_exec, aio_exec },
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
	.m_doc = "zero_ext's C core: partition planner, SIMD dispatch (and, in later parts, CPU Adam, "
		 "NVMe I/O).",
	.m_size = 0,
	.m_methods = zx_methods,
	.m_slots = zx_slots,
};

PyMODINIT_FUNC PyInit__C(void)
{
	return PyModuleDef_Init(&zx_module);
}
