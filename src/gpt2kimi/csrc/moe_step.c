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
#include <stdlib.h>

static float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

static float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One expert's SwiGLU for the m tokens that chose it, token t scaled by ws[t]:
 * outs[t] = down (silu(gate xs[t]) * up xs[t] * ws[t]), gate and up [I, d], down [d, I], rows by
 * output. Each weight row is read once for all m tokens (it stays in the nearest cache between
 * them), so a decoded batch reads a chosen expert once, not once per token that chose it.
 * hidden: room for [m, I]. */
static void swiglu_tokens(int d, int I, int m, const float *const *xs, const float *ws,
                          const float *gate, const float *up, const float *down,
                          float *hidden, float *const *outs) {
    for (int i = 0; i < I; i++) {
        const float *gate_i = gate + (size_t)i * d, *up_i = up + (size_t)i * d;
        for (int t = 0; t < m; t++) {
            const float g = dot(gate_i, xs[t], d), u = dot(up_i, xs[t], d);
            hidden[(size_t)t * I + i] = g * sigmoidf_(g) * u * ws[t];
        }
    }
    for (int c = 0; c < d; c++) {
        const float *down_c = down + (size_t)c * I;
        for (int t = 0; t < m; t++) outs[t][c] = dot(down_c, hidden + (size_t)t * I, I);
    }
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
    const int S = k + (Is > 0); /* each token's parts: its k experts', then the shared one's */
    float choice[E];
    for (int e = 0; e < E; e++) per_expert[e] = 0;
    /* 1. routing, token by token */
    for (int n = 0; n < N; n++) {
        const float *xn = x + (size_t)n * d;
        float *sn = scores + (size_t)n * E, *wn = weights + (size_t)n * k;
        int64_t *en = experts + (size_t)n * k;
        /* the router's scores, and the values the choice is made by */
        for (int e = 0; e < E; e++) sn[e] = dot(w->router + (size_t)e * d, xn, d);
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
    }
    /* 2. expert by expert, the tokens that chose it (bucketed by expert), then the shared
     * expert for every token; each part of each token's output kept apart */
    float *part = malloc(sizeof(float) * (size_t)N * S * d);
    float *hidden = malloc(sizeof(float) * (size_t)N * (I > Is ? I : Is));
    if (!part || !hidden) { /* no memory for a few kilobytes: say so in the output */
        for (size_t i = 0; i < (size_t)N * d; i++) y[i] = NAN;
        free(part);
        free(hidden);
        return;
    }
    int start[E + 1], fill[E], token[N * k], slot[N * k];
    start[0] = 0;
    for (int e = 0; e < E; e++) start[e + 1] = start[e] + (int)per_expert[e];
    for (int e = 0; e < E; e++) fill[e] = start[e];
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            const int p = fill[experts[(size_t)n * k + j]]++;
            token[p] = n;
            slot[p] = j;
        }
    const float *xs[N];
    float ws[N], *outs[N];
    for (int e = 0; e < E; e++) {
        const int m = start[e + 1] - start[e];
        if (m == 0) continue;
        for (int t = 0; t < m; t++) {
            const int n = token[start[e] + t], j = slot[start[e] + t];
            xs[t] = x + (size_t)n * d;
            ws[t] = weights[(size_t)n * k + j];
            outs[t] = part + ((size_t)n * S + j) * d;
        }
        const float *gu = w->gate_up + (size_t)e * 2 * I * d;
        swiglu_tokens(d, I, m, xs, ws, gu, gu + (size_t)I * d, w->down + (size_t)e * d * I,
                      hidden, outs);
    }
    if (Is > 0) {
        for (int n = 0; n < N; n++) {
            xs[n] = x + (size_t)n * d;
            ws[n] = 1.0f;
            outs[n] = part + ((size_t)n * S + k) * d;
        }
        swiglu_tokens(d, Is, N, xs, ws, w->s_gate, w->s_up, w->s_down, hidden, outs);
    }
    /* 3. each token's output: its parts summed in their order, the shared expert's last */
    for (int n = 0; n < N; n++)
        for (int c = 0; c < d; c++) {
            float sum = 0.0f;
            for (int s_ = 0; s_ < S; s_++) sum += part[((size_t)n * S + s_) * d + c];
            y[(size_t)n * d + c] = sum;
        }
    free(part);
    free(hidden);
}
