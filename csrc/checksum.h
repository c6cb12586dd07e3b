/* checksum.h - CRC-32C (Castagnoli) of a byte range, for checkpoint files (zero_ext/checkpoint/files.py):
 * the SSE4.2 crc32 instruction where the CPU has it (every AVX2 CPU), else a table, same values. */
#ifndef ZX_CHECKSUM_H
#define ZX_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* The CRC-32C of crc's message followed by data[0:n] (crc = 0 to start). */
uint32_t zx_crc32c(uint32_t crc, const void *data, size_t n);

/* The table path alone (tests compare the two). */
uint32_t zx_crc32c_table(uint32_t crc, const void *data, size_t n);

#endif /* ZX_CHECKSUM_H */
