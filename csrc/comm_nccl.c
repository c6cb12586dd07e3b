/* comm_nccl.c - NCCL communicators and collectives on a caller-given stream (see cuda_api.h). */
#include "cuda_api.h"
#include "dtype.h"

#include <errno.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

/* ncclResult_t as this library's status: 0 or its negation. */
#define ZX_NCCL(call)                                   \
	do {                                            \
		ncclResult_t zx_rc_ = (call);           \
		if (zx_rc_ != ncclSuccess)              \
			return -(int)zx_rc_;            \
	} while (0)

static int nccl_type(int dtype, ncclDataType_t *out)
{
	switch (dtype) {
	case ZX_F32: *out = ncclFloat32; return 0;
	case ZX_F16: *out = ncclFloat16; return 0;
	case ZX_BF16: *out = ncclBfloat16; return 0;
	case ZX_F64: *out = ncclFloat64; return 0;
	case ZX_I32: *out = ncclInt32; return 0;
	case ZX_I64: *out = ncclInt64; return 0;
	case ZX_U8: *out = ncclUint8; return 0;
	default: return -EINVAL;
	}
}

static int nccl_op(int op, ncclRedOp_t *out)
{
	switch (op) {
	case ZX_SUM: *out = ncclSum; return 0;
	case ZX_AVG: *out = ncclAvg; return 0;
	case ZX_MAX: *out = ncclMax; return 0;
	case ZX_MIN: *out = ncclMin; return 0;
	default: return -EINVAL;
	}
}

const char *zx_cuda_error_string(int status)
{
	if (status == 0)
		return "success";
	if (status == -EINVAL)
		return "invalid argument (dtype, op or pointer)";
	if (status <= -ZX_CUDA_STATUS_BASE)
		return cudaGetErrorString((cudaError_t)(-status - ZX_CUDA_STATUS_BASE));
	return ncclGetErrorString((ncclResult_t)-status);
}

int zx_nccl_unique_id(unsigned char id[ZX_NCCL_ID_BYTES])
{
	ncclUniqueId uid;
	_Static_assert(sizeof(uid.internal) == ZX_NCCL_ID_BYTES, "NCCL unique id size changed");
	ZX_NCCL(ncclGetUniqueId(&uid));
	memcpy(id, uid.internal, ZX_NCCL_ID_BYTES);
	return 0;
}

int zx_nccl_comm_init(void **comm, int world, int rank, const unsigned char id[ZX_NCCL_ID_BYTES])
{
	if (!comm || world < 1 || rank < 0 || rank >= world)
		return -EINVAL;
	ncclUniqueId uid;
	memcpy(uid.internal, id, ZX_NCCL_ID_BYTES);
	ncclComm_t c;
	ZX_NCCL(ncclCommInitRank(&c, world, uid, rank));
	*comm = c;
	return 0;
}

int zx_nccl_comm_destroy(void *comm)
{
	ZX_NCCL(ncclCommDestroy((ncclComm_t)comm));
	return 0;
}

int zx_nccl_comm_abort(void *comm)
{
	ZX_NCCL(ncclCommAbort((ncclComm_t)comm));
	return 0;
}

int zx_nccl_all_gather(void *comm, const void *send, void *recv, size_t count, int dtype, void *stream)
{
	ncclDataType_t t;
	if (nccl_type(dtype, &t))
		return -EINVAL;
	ZX_NCCL(ncclAllGather(send, recv, count, t, (ncclComm_t)comm, (cudaStream_t)stream));
	return 0;
}

int zx_nccl_reduce_scatter(void *comm, const void *send, void *recv, size_t count, int dtype, int op,
			   void *stream)
{
	ncclDataType_t t;
	ncclRedOp_t o;
	if (nccl_type(dtype, &t) || nccl_op(op, &o))
		return -EINVAL;
	ZX_NCCL(ncclReduceScatter(send, recv, count, t, o, (ncclComm_t)comm, (cudaStream_t)stream));
	return 0;
}

int zx_nccl_all_reduce(void *comm, const void *send, void *recv, size_t count, int dtype, int op,
		       void *stream)
{
	ncclDataType_t t;
	ncclRedOp_t o;
	if (nccl_type(dtype, &t) || nccl_op(op, &o))
		return -EINVAL;
	ZX_NCCL(ncclAllReduce(send, recv, count, t, o, (ncclComm_t)comm, (cudaStream_t)stream));
	return 0;
}

int zx_nccl_broadcast(void *comm, const void *send, void *recv, size_t count, int dtype, int root,
		      void *stream)
{
	ncclDataType_t t;
	if (nccl_type(dtype, &t))
		return -EINVAL;
	ZX_NCCL(ncclBroadcast(send, recv, count, t, root, (ncclComm_t)comm, (cudaStream_t)stream));
	return 0;
}

int zx_nccl_group_start(void)
{
	ZX_NCCL(ncclGroupStart());
	return 0;
}

int zx_nccl_group_end(void)
{
	ZX_NCCL(ncclGroupEnd());
	return 0;
}
