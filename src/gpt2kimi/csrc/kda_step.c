/* One decoded token of a Kimi Delta Attention layer, after its input projection, in one call.
 *
 * The same arithmetic as KimiDeltaAttention.step (gpt2kimi/kda.py) from the projected token
 * h = x @ proj on: the short convolution, the L2 norms of q and k, beta, the forget gate, the
 * delta rule's step of the memory, the output gate and its RMSNorm. At decode time each PyTorch
 * call costs a few microseconds whatever it computes, and the step makes about fifty of them over
 * a few thousand numbers; here they are loops over the same numbers. fp32, C-contiguous arrays,
 * one thread. Built by gpt2kimi/native.py; tested equal to the PyTorch step.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* e^x as 2^n e^r, n = round(x / ln 2) and |r| <= ln(2) / 2, e^r by its Taylor series to r^7
 * (the next term is below 6e-9 relative, under fp32's rounding). Plain arithmetic, unlike libm's
 * expf, so that a loop calling it is vectorized: the step takes about a thousand exponentials. */
static inline float exp_(float x) {
    x = x > -87.0f ? x : -87.0f;  /* so that 2^n stays a normal float */
    x = x < 88.0f ? x : 88.0f;
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  /* + 1.5 * 2^23: rounded */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;     /* ln 2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

static float sigmoidf_(float x) { return 1.0f / (1.0f + exp_(-x)); }

/* ln(1 + t) for 0 <= t <= 1 as 2 atanh(s), s = t / (2 + t) <= 1/3, by its series to s^15 (the
 * next term is below 2e-9 relative): plain arithmetic again, so that the loop vectorizes. */
static inline float log1p_(float t) {
    const float s = t / (2.0f + t), s2 = s * s;
    float p = 1.0f / 15.0f;
    p = p * s2 + 1.0f / 13.0f;
    p = p * s2 + 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    return 2.0f * s * p;
}

/* ln(1 + e^x) as max(x, 0) + ln(1 + e^-|x|): the same function as torch.nn.functional.softplus
 * (which is x itself above 20, where the second term is below fp32's rounding of x) */
static inline float softplusf_(float x) {
    return (x > 0.0f ? x : 0.0f) + log1p_(exp_(x > 0.0f ? -x : x));
}

/* A layer's shape and weights, bound once (gpt2kimi/native.py: kda_step_weights).
 *
 * H heads of D channels, conv_size C; N = 3 * H * D (q, k and v side by side).
 * conv_w   [C, N]       the convolution's kernel, oldest input first
 * f_b      [D, H * D]   the forget gate's up-projection, A_log [H], dt_bias [H * D]
 * g_b      [D, H * D]   the output gate's up-projection, g_b_bias [H * D] or NULL
 * norm_w   [D]          the output RMSNorm's weight, norm_eps its epsilon; scale: D^-1/2
 */
typedef struct {
    int H, D, C;
    float norm_eps, scale;
    const float *conv_w, *f_b, *A_log, *dt_bias, *g_b, *g_b_bias, *norm_w;
} kda_weights;

/*
 * B sequences.
 * h        [B, N + H + 2D]  the projected token: q, k, v | beta | forget gate's f_a | gate's g_a
 * conv     [B, C - 1, N]    the convolution's last inputs          -> new_conv [B, C - 1, N]
 * memory   [B, H, D, D]     S, rows by key channel                 -> new_memory
 * out      [B, H * D]       RMSNorm(o) * sigmoid(gate), ready for the output projection
 */
void kda_decode_step(const kda_weights *w, int B, const float *h, const float *conv,
                     const float *memory, float *new_memory, float *new_conv, float *out) {
    const int H = w->H, D = w->D, C = w->C;
    const float *conv_w = w->conv_w, *f_b = w->f_b, *A_log = w->A_log, *dt_bias = w->dt_bias,
                *g_b = w->g_b, *g_b_bias = w->g_b_bias, *norm_w = w->norm_w;
    const float norm_eps = w->norm_eps, scale = w->scale;
    const int HD = H * D, N = 3 * HD, width = N + H + 2 * D;
    float qkv[N], g[HD], alpha[HD], gate[HD], o[HD], decay_rate[H];
    for (int hh = 0; hh < H; hh++) decay_rate[hh] = expf(A_log[hh]);  /* once, not per token */
    for (int b = 0; b < B; b++) {
        const float *hb = h + (size_t)b * width;
        const float *cb = conv + (size_t)b * (C - 1) * N;
        float *nb = new_conv + (size_t)b * (C - 1) * N;
        /* the short convolution over the window [conv; h], then SiLU; the window moves on */
        for (int n = 0; n < N; n++) qkv[n] = 0.0f;
        for (int c = 0; c < C - 1; c++)
            for (int n = 0; n < N; n++) qkv[n] += cb[(size_t)c * N + n] * conv_w[(size_t)c * N + n];
        for (int n = 0; n < N; n++) qkv[n] += hb[n] * conv_w[(size_t)(C - 1) * N + n];
        for (int n = 0; n < N; n++) qkv[n] *= sigmoidf_(qkv[n]);
        for (int c = 0; c < C - 2; c++)
            for (int n = 0; n < N; n++) nb[(size_t)c * N + n] = cb[(size_t)(c + 1) * N + n];
        for (int n = 0; n < N; n++) nb[(size_t)(C - 2) * N + n] = hb[n];
        /* q and k to unit length per head (eps 1e-6, as l2_normalize) */
        for (int part = 0; part < 2; part++)
            for (int hh = 0; hh < H; hh++) {
                float *x = qkv + part * HD + hh * D, ss = 0.0f;
#pragma omp simd reduction(+ : ss)
                for (int i = 0; i < D; i++) ss += x[i] * x[i];
                const float r = 1.0f / sqrtf(ss + 1e-6f);
                for (int i = 0; i < D; i++) x[i] *= r;
            }
        /* the forget gate g = -exp(A_log) softplus(f_a f_b + dt_bias) and the output gate */
        const float *f_a = hb + N + H, *g_a = hb + N + H + D;
        for (int j = 0; j < HD; j++) {
            g[j] = 0.0f;
            gate[j] = g_b_bias ? g_b_bias[j] : 0.0f;
        }
        for (int i = 0; i < D; i++)  /* row by row: the inner loop reads memory in order */
            for (int j = 0; j < HD; j++) {
                g[j] += f_a[i] * f_b[(size_t)i * HD + j];
                gate[j] += g_a[i] * g_b[(size_t)i * HD + j];
            }
        for (int hh = 0; hh < H; hh++)
            for (int i = 0; i < D; i++) {
                const int j = hh * D + i;
                g[j] = -decay_rate[hh] * softplusf_(g[j] + dt_bias[j]);
            }
        for (int j = 0; j < HD; j++) alpha[j] = exp_(g[j]);  /* each key channel's decay */
        for (int hh = 0; hh < H; hh++) {
            const float *q = qkv + hh * D, *k = qkv + HD + hh * D, *v = qkv + 2 * HD + hh * D;
            const float beta = sigmoidf_(hb[N + hh]);
            const float *S0 = memory + ((size_t)b * H + hh) * D * D;
            float *S = new_memory + ((size_t)b * H + hh) * D * D, *oh = o + hh * D;
            /* S <- Diag(exp g) S, then e = beta (v - S^T k), S <- S + k e^T, o = scale S^T q */
            for (int j = 0; j < D; j++) oh[j] = 0.0f;  /* first S^T k, then reused for S^T q */
            for (int i = 0; i < D; i++) {
                const float a = alpha[hh * D + i];
                for (int j = 0; j < D; j++) {
                    const float s = S0[(size_t)i * D + j] * a;
                    S[(size_t)i * D + j] = s;
                    oh[j] += k[i] * s;
                }
            }
            float e[D];  /* the error */
            for (int j = 0; j < D; j++) { e[j] = (v[j] - oh[j]) * beta; oh[j] = 0.0f; }
            /* S <- S + k e^T and o = S^T q row by row, one pass: row i is final once updated */
            for (int i = 0; i < D; i++)
                for (int j = 0; j < D; j++) {
                    const float s = S[(size_t)i * D + j] + k[i] * e[j];
                    S[(size_t)i * D + j] = s;
                    oh[j] += q[i] * s;
                }
            /* RMSNorm over the head's channels, its weight, the sigmoid output gate */
            float ss = 0.0f;
            for (int j = 0; j < D; j++) oh[j] *= scale;
#pragma omp simd reduction(+ : ss)
            for (int j = 0; j < D; j++) ss += oh[j] * oh[j];
            const float r = 1.0f / sqrtf(ss / D + norm_eps);
            float *ob = out + (size_t)b * HD + hh * D;
            for (int j = 0; j < D; j++)
                ob[j] = oh[j] * r * norm_w[j] * sigmoidf_(gate[hh * D + j]);
        }
    }
}
