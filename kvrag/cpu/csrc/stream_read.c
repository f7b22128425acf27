/* The memory's read rate, for kvrag.lab.roofline's floor: a buffer read front to back as the decode step reads its
 * weights (one contiguous run a thread, 16-lane vectors, four in flight a loop). torch's sum over the same
 * buffer reads slower here than the decode step's products do, so a floor measured with it alone was beaten. */
#include "vectors.h"

/* The sum of the buffer's float32 words (bytes: a multiple of 256), the threads each reading one run. */
float stream_read(const float *p, long bytes, int threads) {
    long n = bytes / 4;
    float total = 0;
    _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(+ : total)")
    for (long i = 0; i < n; i += 64) {
        v16 a = load_f32(p + i) + load_f32(p + i + 16), b = load_f32(p + i + 32) + load_f32(p + i + 48);
        total += lanes_sum(a + b);
    }
    return total;
}
