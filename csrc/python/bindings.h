/* bindings.h - what the binding files of zero_ext._C share (csrc/python/: the only code that includes
 * Python.h; the C core in csrc/ knows nothing of Python). */
#ifndef ZX_BINDINGS_H
#define ZX_BINDINGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* An address passed from Python as an int (tensor.data_ptr()) as a pointer. */
#define PTR(x) ((void *)(uintptr_t)(x))

/* Raises for a negative C status (-errno) and returns NULL: `return zx_raise(rc, "what")`. */
PyObject *zx_raise(int64_t status, const char *what);
/* A Python sequence of ints as a fresh int64 array (free with PyMem_Free); *n receives its length. */
int64_t *zx_int64_array(PyObject *seq, Py_ssize_t *n, const char *name);
PyObject *zx_int64_list(const int64_t *v, int64_t n);

/* Each unit's functions (sentinel-terminated), added to the module at exec. */
extern PyMethodDef zx_planner_methods[]; /* bind_planner.c: partition planner, SIMD level */
extern PyMethodDef zx_optim_methods[];   /* bind_optim.c: CPU optimizers, bandwidth floor */
extern PyMethodDef zx_aio_methods[];     /* bind_aio.c: io_uring probe, file checksums */
extern PyMethodDef zx_comm_methods[];    /* bind_comm.c: communicator ids, the reduction kernel */
extern PyMethodDef zx_quant_methods[];   /* bind_quant.c: block quantization (ZeRO++ formats) */
extern PyMethodDef zx_frag_methods[];    /* bind_comm_state.c: one parameter's fragments (safe_state) */
/* bind_aio.c: adds the AioHandle type. */
int zx_aio_exec(PyObject *module);
/* bind_comm.c: adds the Comm and CommOp types. */
int zx_comm_exec(PyObject *module);
/* bind_comm.c: the communicator of a Comm (NULL with an exception set: not a Comm, or destroyed), and
 * an op's failure raised as OSError(errno, message). */
struct zx_comm;
struct zx_comm *zx_comm_of(PyObject *obj);
PyObject *zx_comm_raise(int status, const char *message);

#endif /* ZX_BINDINGS_H */
