/* The 16-lane float32 vectors the decode kernels compute in (GCC/Clang vector extensions), and the one way they
 * sum a vector's lanes. */
#ifndef KVRAG_VECTORS_H
#define KVRAG_VECTORS_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef float v2 __attribute__((vector_size(8)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline v16 load_f32(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

/* v's 16 lanes summed as a fixed tree of vector halves: the same order wherever it is inlined (a loop over the
 * lanes is the compiler's to reorder under -ffast-math, and it may order two copies differently; a token's
 * sums must not depend on which tokens share its pass) */
static inline float lanes_sum(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    v2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
    return c[0] + c[1];
}

#endif
