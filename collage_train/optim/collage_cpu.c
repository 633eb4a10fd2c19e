/* The CollageAdamW step on one contiguous range of bf16 tensors, for CPUs.
 *
 * The same arithmetic as collage_math.collage_tensor_step, element for element: fp32
 * operations on widened bf16 values, each result that the reference rounds to bf16
 * rounded here to nearest-even on its bits (rb). Compiled by collage_cpu.py with
 * -O3 -march=native -ffp-contract=off: no fused multiply-adds (every product is rounded
 * to fp32 on its own, as in the reference), no reassociation, IEEE division and sqrt;
 * "#pragma omp simd" (with -fopenmp-simd, no OpenMP runtime) lets the compiler
 * vectorise the loop, EDQ sums included.
 *
 * TwoSum (mcf.two_sum) rounds six results; only the first two can be inexact. The other
 * four are exact for every pair of bf16 inputs, so their fp32 results are bf16 values
 * already and the kernel does not round them (8 of the 37 roundings per element in plus
 * mode, 4 of 21 in light). tests/exhaustive_two_sum.c checks this on all 2^32
 * input pairs; it is also the known theorem (Boldo, Graillat, Muller 2017: in 2Sum with
 * round-to-nearest, b' = s - a', da = a - a', db = b - b' and da + db are exact).
 *
 * NaN: rb keeps a NaN a NaN without the explicit test torch's conversion makes. Every
 * NaN in this kernel is a widened bf16 NaN or the processor's default NaN, whose low 16
 * bits are zero, so adding the rounding bias cannot carry into the exponent. The payload
 * may differ from torch's (which itself differs between its vector and scalar paths).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float widen(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* fp32 -> nearest bf16 (ties to even), returned widened to fp32. */
static inline float rb(float x) {
    uint32_t u = bits_of(x);
    /* The even bit as (u << 15) >> 31: written as (u >> 16) & 1, gcc turns it into a
     * compare and a masked move (6 vector ops instead of 5). */
    uint32_t r = ((u + 0x7fffu + ((u << 15) >> 31)) >> 16) << 16;
    float f;
    memcpy(&f, &r, 4);
    return f;
}

/* The bf16 bits of a value already rounded by rb. */
static inline bf16 narrow(float rounded) { return (bf16)(bits_of(rounded) >> 16); }

/* The scalars of one step, in the order of collage_math.step_scalars (plus 1 - beta2). */
typedef struct {
    float one_minus_beta1, beta2, beta2_hi, beta2_lo, one_minus_beta2, inv_sqrt_bias2, eps,
        step_size, decay;
} scalars_t;

/* Elements per block: EDQ sums are accumulated in fp32 per block (vectorised), then in
 * double. Each block runs three loops, each with a shorter dependency chain than one
 * loop doing the whole step, so the processor overlaps more iterations; the moments and
 * updates a later loop reads are still in L1 (a block's six arrays and the update buffer
 * take 32 KB). Measured on a 2-core AVX-512 host against the single-loop version: about
 * 10% faster on cache-resident tensors, the same untracked and about 6% faster with the
 * EDQ sums on 33.6M parameters, where memory traffic hides part of the arithmetic. */
#define BLOCK 2048

static inline __attribute__((always_inline)) void step_range(
    const int mode, const int track, const int keep_update, int64_t n, bf16 *theta,
    bf16 *dtheta, bf16 *exp_avg, bf16 *exp_avg_sq, bf16 *dv, const bf16 *grad,
    bf16 *update_out, const scalars_t *c, double *sums) {
    const float omb1 = c->one_minus_beta1, beta2 = c->beta2, beta2_hi = c->beta2_hi,
                beta2_lo = c->beta2_lo, omb2 = c->one_minus_beta2,
                inv_sqrt_bias2 = c->inv_sqrt_bias2, eps = c->eps, step_size = c->step_size,
                decay = c->decay;
    double acc[6] = {0, 0, 0, 0, 0, 0};
    float intended[BLOCK] __attribute__((aligned(64)));
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        /* 1. The moments: m, and v (with its remainder dv in plus mode). */
#pragma omp simd
        for (int64_t i = start; i < end; i++) {
            const float g = widen(grad[i]);
            const float ea = widen(exp_avg[i]);
            const float square = g * g; /* exact in fp32 */
            exp_avg[i] = narrow(rb(ea + omb1 * (g - ea)));
            if (mode == 2) {
                /* mcf.mul((v, dv), (beta2_hi, beta2_lo)) */
                const float x = widen(exp_avg_sq[i]), dx = widen(dv[i]);
                const float p = rb(x * beta2_hi);
                const float e = rb(x * beta2_hi - p);
                const float d = rb(rb(rb(dx * beta2_hi) + rb(x * beta2_lo)) + e);
                const float s = rb(p + d);
                const float t = rb(d - rb(s - p));
                /* mcf.grow((s, t), fl(fl(g^2) * (1 - beta2))) */
                const float a = rb(rb(square) * omb2);
                const float s2 = rb(s + a);
                const float a_approx = rb(s2 - a);
                const float b_approx = s2 - a_approx; /* exact: see TwoSum above */
                const float t2 = (s - a_approx) + (a - b_approx);
                const float d2 = rb(t + t2);
                const float v = rb(s2 + d2);
                exp_avg_sq[i] = narrow(v);
                dv[i] = narrow(rb(d2 - rb(v - s2)));
            } else {
                exp_avg_sq[i] = narrow(rb(rb(widen(exp_avg_sq[i]) * beta2) + omb2 * square));
            }
        }
        /* 2. The intended update, from the new moments. */
#pragma omp simd
        for (int64_t i = start; i < end; i++) {
            float denom = rb(sqrtf(widen(exp_avg_sq[i])));
            denom = rb(rb(denom * inv_sqrt_bias2) + eps);
            const float update = rb(rb(widen(exp_avg[i]) / denom) * step_size);
            intended[i - start] = rb(update + decay * widen(theta[i]));
        }
        /* 3. The weights (and the EDQ sums of this block). */
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5)
        for (int64_t i = start; i < end; i++) {
            const float th = widen(theta[i]), update = intended[i - start];
            float new_theta, new_dtheta = 0.0f;
            if (mode == 0) {
                new_theta = rb(th + update);
            } else {
                /* mcf.grow((theta, dtheta), update) */
                const float s = rb(th + update);
                const float a_approx = rb(s - update);
                const float b_approx = s - a_approx; /* exact: see TwoSum above */
                const float t = (th - a_approx) + (update - b_approx);
                const float d = rb(widen(dtheta[i]) + t);
                new_theta = rb(s + d);
                new_dtheta = rb(d - rb(new_theta - s));
                dtheta[i] = narrow(new_dtheta);
            }
            if (track) { /* metrics.descent.FIELDS */
                const float realised = new_theta - th;
                /* Sums, not results: fused multiply-adds are fine here (fewer ops). */
                s0 = fmaf(realised, update, s0);
                s1 = fmaf(update, update, s1);
                s2 += update != 0.0f ? 1.0f : 0.0f;
                s3 += (update != 0.0f && realised == 0.0f) ? 1.0f : 0.0f;
                s4 = fmaf(new_dtheta, new_dtheta, s4);
                s5 = fmaf(new_dtheta, update, s5);
            }
            if (keep_update) update_out[i] = narrow(update);
            theta[i] = narrow(new_theta);
        }
        acc[0] += s0, acc[1] += s1, acc[2] += s2, acc[3] += s3, acc[4] += s4, acc[5] += s5;
    }
    if (track)
        for (int k = 0; k < 6; k++) sums[k] = acc[k];
}

/* One specialisation per (mode, output): the branches above fold away in each. */
#define VARIANT(MODE, TRACK, KEEP)                                                            \
    static void step_##MODE##TRACK##KEEP(int64_t n, bf16 *theta, bf16 *dtheta, bf16 *m,      \
                                         bf16 *v, bf16 *dv, const bf16 *g, bf16 *update,     \
                                         const scalars_t *c, double *sums) {                 \
        step_range(MODE, TRACK, KEEP, n, theta, dtheta, m, v, dv, g, update, c, sums);        \
    }
VARIANT(0, 0, 0) VARIANT(0, 1, 0) VARIANT(0, 0, 1)
VARIANT(1, 0, 0) VARIANT(1, 1, 0) VARIANT(1, 0, 1)
VARIANT(2, 0, 0) VARIANT(2, 1, 0) VARIANT(2, 0, 1)

typedef void (*variant_t)(int64_t, bf16 *, bf16 *, bf16 *, bf16 *, bf16 *, const bf16 *,
                          bf16 *, const scalars_t *, double *);
static const variant_t VARIANTS[3][3] = {{step_000, step_010, step_001},
                                         {step_100, step_110, step_101},
                                         {step_200, step_210, step_201}};

/* mode: 0 none, 1 light, 2 plus. out: 0 nothing, 1 the six EDQ sums into sums[0..5],
 * 2 the intended update into update (callers that split the sums do it themselves). */
void collage_step(int64_t n, int mode, int out, bf16 *theta, bf16 *dtheta, bf16 *exp_avg,
                  bf16 *exp_avg_sq, bf16 *dv, const bf16 *grad, bf16 *update,
                  const scalars_t *c, double *sums) {
    VARIANTS[mode][out](n, theta, dtheta, exp_avg, exp_avg_sq, dv, grad, update, c, sums);
}
