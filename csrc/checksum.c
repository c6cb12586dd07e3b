/* checksum.c - CRC-32C (see checksum.h). The instruction path folds 8 bytes per crc32 instruction on
 * three lanes at once (about 20 GB/s on one core), so a checkpoint's checksum costs a few percent of
 * writing it. */
#include "checksum.h"

#include <pthread.h>
#include <string.h>

#include "cpu_features.h"

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t table[256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void make_table(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1u)));
		table[i] = c;
	}
}

uint32_t zx_crc32c_table(uint32_t crc, const void *data, size_t n)
{
	pthread_once(&table_once, make_table);
	const unsigned char *p = data;
	crc = ~crc;
	while (n--)
		crc = (crc >> 8) ^ table[(crc ^ *p++) & 0xFF];
	return ~crc;
}

#if ZX_HAVE_X86
#include <nmmintrin.h>

/* Three lanes of LANE bytes each go through three independent crc32 chains (the instruction has a
 * latency of 3 cycles and a throughput of 1), then are joined: for raw (uninverted) registers,
 * crc(r, A||B) = shift(crc(r, A)) ^ crc(0, B), where shift multiplies by x^(8 * LANE) mod P, a linear
 * map looked up byte by byte in shift_table (built once from the 32 basis vectors). */
#define LANE 4096
static uint32_t shift_table[4][256];
static pthread_once_t shift_once = PTHREAD_ONCE_INIT;

static uint32_t raw_zeros(uint32_t c, size_t n) /* crc of n zero bytes from register c, no inversion */
{
	while (n--)
		c = (c >> 8) ^ table[c & 0xFF];
	return c;
}

static void make_shift_table(void)
{
	pthread_once(&table_once, make_table);
	uint32_t basis[32];
	for (int i = 0; i < 32; i++)
		basis[i] = raw_zeros(1u << i, LANE);
	for (int k = 0; k < 4; k++)
		for (int b = 0; b < 256; b++) {
			uint32_t v = 0;
			for (int j = 0; j < 8; j++)
				if (b & (1 << j))
					v ^= basis[8 * k + j];
			shift_table[k][b] = v;
		}
}

static uint32_t shift(uint32_t c)
{
	return shift_table[0][c & 0xFF] ^ shift_table[1][(c >> 8) & 0xFF] ^ shift_table[2][(c >> 16) & 0xFF] ^
	       shift_table[3][c >> 24];
}

static inline uint64_t load64(const unsigned char *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return v;
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *data, size_t n)
{
	const unsigned char *p = data;
	uint64_t c = ~crc;
	for (; n && ((uintptr_t)p & 7); n--)
		c = _mm_crc32_u8((uint32_t)c, *p++);
	if (n >= 3 * LANE)
		pthread_once(&shift_once, make_shift_table);
	for (; n >= 3 * LANE; n -= 3 * LANE, p += 3 * LANE) {
		uint64_t b = 0, d = 0;
		for (size_t i = 0; i < LANE; i += 8) {
			c = _mm_crc32_u64(c, load64(p + i));
			b = _mm_crc32_u64(b, load64(p + LANE + i));
			d = _mm_crc32_u64(d, load64(p + 2 * LANE + i));
		}
		c = shift(shift((uint32_t)c) ^ (uint32_t)b) ^ (uint32_t)d;
	}
	for (; n >= 8; n -= 8, p += 8)
		c = _mm_crc32_u64(c, load64(p));
	for (; n; n--)
		c = _mm_crc32_u8((uint32_t)c, *p++);
	return ~(uint32_t)c;
}
#endif

uint32_t zx_crc32c(uint32_t crc, const void *data, size_t n)
{
#if ZX_HAVE_X86
	if (zx_simd_supported() >= ZX_SIMD_AVX2) /* (every AVX2 CPU has SSE4.2) */
		return crc32c_hw(crc, data, n);
#endif
	return zx_crc32c_table(crc, data, n);
}
