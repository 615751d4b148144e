/* RMSNorm of a decoded token's few rows, in one call: x / sqrt(mean(x^2) + eps) * weight.
 *
 * The arithmetic of torch.nn.functional.rms_norm in fp32, whose CPU form is half a dozen PyTorch
 * calls (square, mean, add, rsqrt, two products), each costing microseconds of dispatch over a
 * row of a few hundred numbers; a decode step of chapter 8's hybrid runs nine of them. fp32,
 * C-contiguous arrays, one thread. Built by gpt2kimi/native.py; tested equal to PyTorch's.
 */
#include <math.h>

/* rows rows of dim numbers: x [rows, dim], weight [dim] -> out [rows, dim] */
void rms_norm(int rows, int dim, float eps, const float *x, const float *weight, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * dim;
        float *yr = out + (long)r * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < dim; i++) sum += xr[i] * xr[i];
        const float inv_rms = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int i = 0; i < dim; i++) yr[i] = xr[i] * inv_rms * weight[i];
    }
}
