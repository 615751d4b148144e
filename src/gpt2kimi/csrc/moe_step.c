/* A few decoded tokens through a Mixture-of-Experts layer, router to output, in one call.
 *
 * The same arithmetic as MoE.forward (gpt2kimi/moe.py) for a handful of tokens: the router's
 * scores, the top-k choice by score + bias, the chosen weights, each chosen expert's SwiGLU
 * scaled by its weight, and the shared expert. At decode time the PyTorch layer makes about
 * forty calls per token over a few hundred thousand weights, each costing microseconds of
 * dispatch; here they are loops over the same numbers. Among exactly equal scores the lower
 * expert index is chosen (torch.topk leaves that order open). fp32, C-contiguous arrays, one
 * thread. Built by gpt2kimi/native.py; tested equal to the PyTorch layer.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

static float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

static float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[r] = a[r] . x for the `rows` rows of a [rows, n], four rows at a time: one dot product is
 * a chain of dependent additions, four are independent chains the CPU runs side by side, and x
 * is read once for the four. The same sums as dot(), each in its own order (fp32 rounding). */
static void matvec(const float *a, const float *x, int rows, int n, float *out) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *a0 = a + (size_t)r * n, *a1 = a0 + n, *a2 = a1 + n, *a3 = a2 + n;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int i = 0; i < n; i++) {
            s0 += a0[i] * x[i];
            s1 += a1[i] * x[i];
            s2 += a2[i] * x[i];
            s3 += a3[i] * x[i];
        }
        out[r] = s0, out[r + 1] = s1, out[r + 2] = s2, out[r + 3] = s3;
    }
    for (; r < rows; r++) out[r] = dot(a + (size_t)r * n, x, n);
}

/* y += down (silu(gate x) * up x * w): gate, up [I, d] and down [d, I], rows by output;
 * hidden and scratch hold I numbers each, out d */
static void swiglu_add(int d, int I, const float *x, const float *gate, const float *up,
                       const float *down, float w, float *y, float *hidden, float *scratch,
                       float *out) {
    matvec(gate, x, I, d, hidden);
    matvec(up, x, I, d, scratch);
    for (int i = 0; i < I; i++) {
        const float g = hidden[i];
        hidden[i] = g * sigmoidf_(g) * scratch[i] * w;
    }
    matvec(down, hidden, d, I, out);
    for (int j = 0; j < d; j++) y[j] += out[j];
}

/* A layer's shape and weights, bound once (gpt2kimi/native.py: moe_step_weights).
 *
 * d the model's width, E experts of width I, k chosen per token; a shared expert of width Is
 * (Is = 0: none). softmax 0: a sigmoid per expert (DeepSeek-V3, Kimi); 1: a softmax (Mixtral).
 * norm_topk 1: the k weights divided by their sum; then times scaling.
 * router [E, d]; gate_up [E, 2I, d] each expert's gate rows, then its up rows; down [E, d, I];
 * s_gate, s_up [Is, d] and s_down [d, Is] the shared expert. Every matrix rows by output.
 */
typedef struct {
    int d, E, k, I, Is, softmax, norm_topk;
    float scaling;
    const float *router, *gate_up, *down, *s_gate, *s_up, *s_down;
} moe_weights;

/*
 * x          [N, d]   the tokens; bias [E] the router's selection bias (or NULL)
 * y          [N, d]   the layer's output
 * scores     [N, E]   the router's scores before the bias
 * experts    [N, k]   the chosen experts (int64), weights [N, k] their weights
 * per_expert [E]      how many tokens each expert received (int64)
 */
void moe_decode_step(const moe_weights *w, int N, const float *x, const float *bias, float *y,
                     float *scores, int64_t *experts, float *weights, int64_t *per_expert) {
    const int d = w->d, E = w->E, k = w->k, I = w->I, Is = w->Is;
    float choice[E], hidden[I > Is ? I : Is], scratch[I > Is ? I : Is], out[d];
    for (int e = 0; e < E; e++) per_expert[e] = 0;
    for (int n = 0; n < N; n++) {
        const float *xn = x + (size_t)n * d;
        float *yn = y + (size_t)n * d, *sn = scores + (size_t)n * E, *wn = weights + (size_t)n * k;
        int64_t *en = experts + (size_t)n * k;
        /* the router's scores, and the values the choice is made by */
        matvec(w->router, xn, E, d, sn);
        if (w->softmax) {
            float top = sn[0], sum = 0.0f;
            for (int e = 1; e < E; e++) top = sn[e] > top ? sn[e] : top;
            for (int e = 0; e < E; e++) sum += sn[e] = expf(sn[e] - top);
            for (int e = 0; e < E; e++) sn[e] /= sum;
        } else {
            for (int e = 0; e < E; e++) sn[e] = sigmoidf_(sn[e]);
        }
        for (int e = 0; e < E; e++) choice[e] = sn[e] + (bias ? bias[e] : 0.0f);
        /* the k best, one pass each (k is a handful), skipping the experts already chosen */
        float total = 0.0f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= en[i] == e;
                if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
            }
            en[j] = best;
            wn[j] = sn[best];
            total += wn[j];
            per_expert[best]++;
        }
        for (int j = 0; j < k; j++)
            wn[j] = (w->norm_topk ? wn[j] / (total + 1e-20f) : wn[j]) * w->scaling;
        /* the chosen experts, each scaled by its weight, then the shared expert */
        for (int j = 0; j < d; j++) yn[j] = 0.0f;
        for (int j = 0; j < k; j++) {
            const float *gu = w->gate_up + (size_t)en[j] * 2 * I * d;
            swiglu_add(d, I, xn, gu, gu + (size_t)I * d, w->down + (size_t)en[j] * d * I, wn[j],
                       yn, hidden, scratch, out);
        }
        if (Is > 0)
            swiglu_add(d, Is, xn, w->s_gate, w->s_up, w->s_down, 1.0f, yn, hidden, scratch, out);
    }
}
