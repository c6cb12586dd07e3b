// quant.cu - block quantization on the GPU, the format of csrc/quant.h (int8 / int4 with one fp32
// scale per block), on the caller's stream. The same arithmetic as the C reference, every operation
// rounded explicitly (no contraction into FMA), so both give the same integers and scales; NaN's
// bit pattern in a bf16 output is CUDA's, not torch's.
#include "cuda_api.h"
#include "dtype.h"

#include <cerrno>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const void *p, int dtype, long long i)
{
	switch (dtype) {
	case ZX_F16: return __half2float(static_cast<const __half *>(p)[i]);
	case ZX_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
	default: return static_cast<const float *>(p)[i];
	}
}

__device__ __forceinline__ void store(void *p, int dtype, long long i, float v)
{
	switch (dtype) {
	case ZX_F16: static_cast<__half *>(p)[i] = __float2half_rn(v); break;
	case ZX_BF16: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); break;
	default: static_cast<float *>(p)[i] = v; break;
	}
}

__device__ __forceinline__ int quant_one(float x, float inv, int level)
{
	float t = rintf(__fmul_rn(x, inv));
	return (int)fminf(fmaxf(t, (float)-level), (float)level);
}

// One CUDA block per quantization block: the block's amax (and whether it holds NaN / inf) by a
// shared-memory reduction, then every thread writes its elements (int4: its pairs).
__global__ void quantize_kernel(const void *src, int dtype, long long n, long long block, int int4,
				int level, unsigned char *q, float *scales)
{
	__shared__ float s_max[kThreads];
	__shared__ int s_bad[kThreads];
	const long long b = blockIdx.x * block, e = b + block < n ? b + block : n;
	float m = 0.0f;
	int bad = 0;
	for (long long i = b + threadIdx.x; i < e; i += blockDim.x) {
		float a = fabsf(load(src, dtype, i));
		if (!(a <= 3.402823466e38f))
			bad = 1;
		else
			m = fmaxf(m, a);
	}
	s_max[threadIdx.x] = m;
	s_bad[threadIdx.x] = bad;
	__syncthreads();
	for (int w = blockDim.x / 2; w > 0; w /= 2) {
		if (threadIdx.x < w) {
			s_max[threadIdx.x] = fmaxf(s_max[threadIdx.x], s_max[threadIdx.x + w]);
			s_bad[threadIdx.x] |= s_bad[threadIdx.x + w];
		}
		__syncthreads();
	}
	const float amax = s_max[0];
	bad = s_bad[0];
	if (threadIdx.x == 0)
		scales[blockIdx.x] = bad ? __int_as_float(0x7fc00000) : __fdiv_rn(amax, (float)level);
	const float inv = bad || amax == 0.0f ? 0.0f : __fdiv_rn((float)level, amax);
	if (!int4) {
		for (long long i = b + threadIdx.x; i < e; i += blockDim.x)
			reinterpret_cast<signed char *>(q)[i] = bad ? 0 : (signed char)quant_one(load(src, dtype, i), inv, level);
		return;
	}
	for (long long i = b + 2 * threadIdx.x; i < e; i += 2 * blockDim.x) {
		int lo = bad ? 0 : quant_one(load(src, dtype, i), inv, level);
		int hi = bad || i + 1 >= e ? 0 : quant_one(load(src, dtype, i + 1), inv, level);
		q[i >> 1] = (unsigned char)((lo & 0xf) | ((hi & 0xf) << 4));
	}
}

__global__ void dequantize_kernel(const unsigned char *q, const float *scales, long long n, long long block,
				  int int4, int dtype, void *dst, int accumulate)
{
	for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
	     i += (long long)gridDim.x * blockDim.x) {
		int v;
		if (int4) {
			int nib = (i & 1) ? q[i >> 1] >> 4 : q[i >> 1] & 0xf;
			v = (nib ^ 8) - 8;
		} else {
			v = reinterpret_cast<const signed char *>(q)[i];
		}
		float y = __fmul_rn((float)v, scales[i / block]);
		if (accumulate)
			static_cast<float *>(dst)[i] = __fadd_rn(static_cast<float *>(dst)[i], y);
		else
			store(dst, dtype, i, y);
	}
}

bool is_float(int dtype) { return dtype == ZX_F32 || dtype == ZX_F16 || dtype == ZX_BF16; }

bool bad_shape(int format, long long n, long long block)
{
	return (format != 0 && format != 1) || n < 0 || block < 1 || (format == 1 && (block & 1)) ||
	       (n + block - 1) / block > 0x7fffffffLL;
}

int launched()
{
	cudaError_t err = cudaGetLastError();
	return err == cudaSuccess ? 0 : -(ZX_CUDA_STATUS_BASE + (int)err);
}

} // namespace

extern "C" int zx_cuda_quantize(int format, int dtype, const void *src, long long n, long long block, void *q,
				float *scales, void *stream)
{
	if (bad_shape(format, n, block) || !is_float(dtype) || (n && (!src || !q || !scales)))
		return -EINVAL;
	if (n == 0)
		return 0;
	unsigned nblocks = (unsigned)((n + block - 1) / block);
	quantize_kernel<<<nblocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
		src, dtype, n, block, format == 1, format == 1 ? 7 : 127, static_cast<unsigned char *>(q), scales);
	return launched();
}

extern "C" int zx_cuda_dequantize(int format, const void *q, const float *scales, long long n, long long block,
				  int dtype, void *dst, int accumulate, void *stream)
{
	if (bad_shape(format, n, block) || !is_float(dtype) || (accumulate && dtype != ZX_F32) ||
	    (n && (!q || !scales || !dst)))
		return -EINVAL;
	if (n == 0)
		return 0;
	long long grid = (n + kThreads - 1) / kThreads;
	if (grid > 65535LL * 8)
		grid = 65535LL * 8;
	dequantize_kernel<<<(unsigned)grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
		static_cast<const unsigned char *>(q), scales, n, block, format == 1, dtype, dst, accumulate);
	return launched();
}
