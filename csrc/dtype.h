/* dtype.h - element types as they cross from Python into C (the Python layer maps torch dtypes). */
#ifndef ZX_DTYPE_H
#define ZX_DTYPE_H

typedef enum {
	ZX_F32 = 0,
	ZX_F16 = 1,
	ZX_BF16 = 2,
	ZX_F64 = 3,
	ZX_I32 = 4,
	ZX_I64 = 5,
	ZX_U8 = 6,
} zx_dtype;

/* Bytes per element, 0 for an unknown type. */
static inline int zx_dtype_size(int dtype)
{
	static const int size[] = { 4, 2, 2, 8, 4, 8, 1 };
	return dtype >= 0 && dtype < (int)(sizeof(size) / sizeof(size[0])) ? size[dtype] : 0;
}

#endif /* ZX_DTYPE_H */
