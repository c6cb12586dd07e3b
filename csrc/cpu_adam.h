/* cpu_adam.h - CPU optimizers on fp32 master state: Adam/AdamW, Adagrad, Lion, plus the gradient
 * norm pass and the fp32 -> bf16/fp16 cast that the offloaded step is built from.
 *
 * Every step works on a list of tensors in one call (a ZeRO sub-group, or all the parameters of a
 * param group with the same step count), so per-call overhead is paid once, not per tensor. The
 * work is cut into tiles shared by the threads of thread_pool.h. Each call does ONE pass over
 * memory: the gradient is multiplied by grad_scale as it is loaded (1/loss_scale times the clip
 * coefficient), the state and parameters are updated, and, where t->out is set, the new parameters
 * are also written as bf16 or fp16 (round to nearest even, exactly as torch's .to() does:
 * subnormals kept, infinities kept, NaN as torch writes it, see zx_f32_to_bf16 below).
 *
 * Arithmetic follows torch.optim's single-tensor code operation for operation (same roundings, FMA
 * where torch's vectorised CPU kernels use FMA), so the AVX2 and AVX-512 paths give torch's bits;
 * the portable scalar path differs only where it rounds an FMA twice.
 *
 * isa: -1 for zx_simd_level() (the best this CPU has, capped by ZERO_EXT_ISA), or a zx_simd value,
 * which must be <= zx_simd_supported(). All functions return 0 or -errno (-EINVAL for bad
 * arguments, -ENOMEM); they never print. They may run for long: call them without the GIL.
 */
#ifndef ZX_CPU_ADAM_H
#define ZX_CPU_ADAM_H

#include <stdint.h>

/* One tensor of a step. Pointers need only their natural alignment (4 bytes, 2 for out); unused
 * ones may be NULL, and all may be NULL when numel == 0. */
typedef struct zx_optim_tensor {
	float *param;	      /* (numel,) fp32 master parameters, updated in place */
	const float *grad;    /* (numel,) fp32 gradients, read only */
	float *exp_avg;	      /* (numel,) fp32 first moment: Adam, Lion */
	float *exp_avg_sq;    /* (numel,) fp32 second moment (Adam) or sum of squares (Adagrad) */
	void *out;	      /* (numel,) bf16/fp16 copy of the new parameters, or NULL for none */
	int64_t numel;
} zx_optim_tensor;

typedef struct zx_adam_config {
	double lr;	     /* e.g. 1e-3 */
	double beta1, beta2; /* e.g. 0.9, 0.999 */
	double eps;	     /* e.g. 1e-8 */
	double weight_decay; /* 0 for none */
	int64_t step;	     /* the step being taken, counted from 1 */
	int bias_correction; /* 1: divide by 1 - beta^step as torch does; 0: use m and v as they are */
	int adamw_mode;	     /* 1: decoupled decay p *= 1 - lr*wd (AdamW); 0: g += wd*p (Adam) */
	double grad_scale;   /* every gradient is multiplied by this first; 1 for none */
} zx_adam_config;

/* Adam/AdamW step on ntensors tensors (t: (ntensors,)): param, grad, exp_avg and exp_avg_sq must
 * be set. out_dtype (ZX_BF16 or ZX_F16 from dtype.h) is the type of every non-NULL t[i].out. */
int zx_adam_step(const zx_adam_config *cfg, const zx_optim_tensor *t, int64_t ntensors,
		 int out_dtype, int isa);

typedef struct zx_adagrad_config {
	double lr;	     /* e.g. 1e-2 */
	double eps;	     /* e.g. 1e-10 */
	double weight_decay; /* L2, added to the gradient; 0 for none */
	double grad_scale;   /* every gradient is multiplied by this first; 1 for none */
} zx_adagrad_config;

/* Adagrad step (torch.optim.Adagrad with lr_decay 0 and initial_accumulator_value 0):
 * param, grad and exp_avg_sq (the sum of squares) must be set. */
int zx_adagrad_step(const zx_adagrad_config *cfg, const zx_optim_tensor *t, int64_t ntensors,
		    int out_dtype, int isa);

typedef struct zx_lion_config {
	double lr;	     /* e.g. 1e-4 */
	double beta1, beta2; /* e.g. 0.9, 0.99 */
	double weight_decay; /* decoupled: p *= 1 - lr*wd */
	double grad_scale;   /* every gradient is multiplied by this first; 1 for none */
} zx_lion_config;

/* Lion step: c = lerp(m, g, 1-beta1); p = p*(1 - lr*wd) - lr*sign(c); m = lerp(m, g, 1-beta2).
 * sign is torch.sign: 0 for 0 and for NaN. param, grad and exp_avg must be set. */
int zx_lion_step(const zx_lion_config *cfg, const zx_optim_tensor *t, int64_t ntensors,
		 int out_dtype, int isa);

/* The sum of squares of n gradient values at src (src_dtype: ZX_F32, ZX_BF16 or ZX_F16), and, when
 * dst is not NULL, their fp32 copy into dst (n,) in the same pass: the norm is computed while the
 * gradient arrives from the device or from the reduce-scatter buffer. Summed in double, tile by
 * tile in a fixed order, so the result does not depend on the thread count. Inf/NaN in the
 * gradients give an Inf/NaN sum (the overflow check). dst may equal src for ZX_F32. */
int zx_grad_sqnorm(float *dst, const void *src, int src_dtype, int64_t n, int isa, double *sumsq);

/* dst (n,) of dst_dtype (ZX_BF16 or ZX_F16) = src (n,) fp32, rounded as the steps round t->out. */
int zx_cast_f32(void *dst, int dst_dtype, const float *src, int64_t n, int isa);

/* Threads of every call above (thread_pool.h); n in 1..256. */
int zx_optim_set_threads(int n);
int zx_optim_threads(void);

/* Element conversions used by the scalar path, exposed for tests. bf16: NaN becomes 0xFFFF, which
 * is what torch's vectorised CPU cast writes (its scalar fallback would write 0x7FC0). fp16: what
 * the F16C instruction (and so torch) writes: NaN keeps its sign and top payload bits, quieted. */
uint16_t zx_f32_to_bf16(float x);
uint16_t zx_f32_to_f16(float x);

#endif /* ZX_CPU_ADAM_H */
