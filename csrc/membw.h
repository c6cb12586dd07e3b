/* membw.h - the memory-bandwidth floor of the CPU optimizers, for benchmarks.
 *
 * A kernel that moves exactly the bytes an Adam step moves (reads param, grad, exp_avg and
 * exp_avg_sq; writes param, exp_avg and exp_avg_sq; with out set, also writes the 2-byte copy)
 * with trivial arithmetic, through the same tiles and threads as zx_adam_step, and the same
 * prefetch. On data that does not fit in cache it runs at the memory wall, and benchmarks report
 * Adam's speed as a fraction of it; an Adam loop that spreads its stores between arithmetic can
 * come out a few percent above it (the AVX2 path did, 1.02-1.05 at 1e8 elements on huge pages).
 */
#ifndef ZX_MEMBW_H
#define ZX_MEMBW_H

#include <stdint.h>

#include "cpu_adam.h"

/* p += g; m += g; v += g; out = the top 16 bits of the new p where set (t: (ntensors,), the
 * fields as in zx_adam_step; out_dtype as there). isa as in cpu_adam.h. Returns 0 or -errno. */
int zx_membw_adam(const zx_optim_tensor *t, int64_t ntensors, int out_dtype, int isa);

#endif /* ZX_MEMBW_H */
