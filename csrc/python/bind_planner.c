/* bind_planner.c - zero_ext._C's partition planner (planner.h) and SIMD level (cpu_features.h). */
#include "bindings.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_features.h"
#include "planner.h"

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

/* The numels sequence of a planner call as an int64 array, and *out a fresh array of as many
 * int64 for the call's answer; free both with PyMem_Free. NULL, with the exception set and nothing
 * to free, on failure. */
static int64_t *numels_with_out(PyObject *seq, const char *name, Py_ssize_t *n, int64_t **out)
{
	int64_t *numel = zx_int64_array(seq, n, name);
	if (!numel)
		return NULL;
	*out = PyMem_Malloc((size_t)(*n > 0 ? *n : 1) * sizeof(int64_t));
	if (!*out) {
		PyMem_Free(numel);
		PyErr_NoMemory();
		return NULL;
	}
	return numel;
}

/* The numels and order sequences of a bucket call as int64 arrays; free both with PyMem_Free.
 * -1, with the exception set and nothing to free, on failure. */
static int numels_and_order(PyObject *seq, PyObject *oseq, int64_t **numel, Py_ssize_t *n,
			    int64_t **order, Py_ssize_t *count)
{
	*numel = zx_int64_array(seq, n, "numels");
	if (!*numel)
		return -1;
	*order = zx_int64_array(oseq, count, "order");
	if (!*order) {
		PyMem_Free(*numel);
		return -1;
	}
	return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Partition planner (planner.h) */

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
	int64_t *offset, *numel = numels_with_out(seq, "numels", &n, &offset);
	if (!numel)
		return NULL;
	int64_t padded = zx_flat_layout(numel, n, world, align, offset);
	if (padded < 0) {
		zx_raise(padded, "flat_layout");
	} else {
		PyObject *offsets = zx_int64_list(offset, n);
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
	int64_t *numel = zx_int64_array(seq, &n, "numels");
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
	Py_ssize_t n, count;
	int64_t *numel, *order;
	if (numels_and_order(seq, oseq, &numel, &n, &order, &count))
		return NULL;
	ZX_PIECES(zx_flat_bucket_pieces(numel, n, world, align, order, count, out, cap),
		  "flat_bucket_pieces");
	PyMem_Free(order);
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
	int64_t *group_of, *numel = numels_with_out(seq, "numels", &n, &group_of);
	if (!numel)
		return NULL;
	int64_t groups = zx_sub_groups(numel, n, world, size, group_of);
	result = groups < 0 ? zx_raise(groups, "sub_groups") : zx_int64_list(group_of, n);
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
	Py_ssize_t n, count;
	int64_t *numel, *order, block = 0;
	if (numels_and_order(seq, oseq, &numel, &n, &order, &count))
		return NULL;
	ZX_PIECES(zx_shard_bucket_pieces(numel, n, world, order, count, &block, out, cap),
		  "shard_bucket_pieces");
	if (result)
		result = Py_BuildValue("(LN)", (long long)block, result);
	PyMem_Free(order);
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
	int64_t *bucket_of, *sizes = numels_with_out(seq, "sizes", &n, &bucket_of);
	if (!sizes)
		return NULL;
	int64_t *order = NULL;
	if (oseq != Py_None) {
		order = zx_int64_array(oseq, &count, "order");
		if (!order)
			goto done;
		if (count != n) {
			PyErr_SetString(PyExc_ValueError, "buckets: order must list every item once");
			goto done;
		}
	}
	int64_t nb = zx_buckets(sizes, n, order, size, bucket_of);
	result = nb < 0 ? zx_raise(nb, "buckets") : zx_int64_list(bucket_of, n);
done:
	PyMem_Free(bucket_of);
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

PyMethodDef zx_planner_methods[] = {
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
	{ NULL, NULL, 0, NULL },
};
