/* The Collage8bitAdamW step on one contiguous range of whole 8-bit blocks, for CPUs.
 *
 * The arithmetic of eight_bit.Collage8bitAdamW._step_param (eager), element for element
 * and bit for bit: fp32 operations in the same order, no fused multiply-adds
 * (-ffp-contract=off, as cpu_kernel.c), IEEE division and sqrt, bf16 roundings to
 * nearest-even on the bits (rb). One pass over each block of `block` elements:
 *
 *   1. dequantise m and v (code * absmax, one fp32 product each), update them, form the
 *      bf16 update and grow (theta, dtheta) with it (mcf.grow; TwoSum's last four
 *      roundings, exact for bf16 operands, left out as in cpu_kernel.c), keep the new m
 *      and v in block-local fp32 buffers and their largest magnitudes;
 *   2. quantise the block with its new absmax (blockwise8.quantize): a whole block
 *      multiplies by the fp32 reciprocal of max(absmax, 1e-38), a shorter last block
 *      divides by it and stores it; m rounds to the nearest code (ties to the lower), v
 *      stochastically between its two neighbouring codes with uniform() of the element's
 *      random bits (rounding_noise: lowbias32 twice, keys from the host), and a positive v
 *      is never stored as code 0.
 *
 * The nearest-code searches do not bisect the 256-entry maps (eight dependent loads):
 * a table over the top 16 bits of x (sign, exponent, 7 mantissa bits: one cell per bf16
 * interval, exponents below 2^-23 folded into one row) holds the smallest count over
 * the cell; the Python side checks when it builds the tables that no cell holds more
 * than one midpoint (or code), so one comparison against the map finishes the count.
 *
 * NaN and infinite moments are outside the bitwise contract (torch's amax propagates a
 * NaN, this kernel's max drops it); finite inputs are bitwise.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float widen(bf16 h) { return from_bits((uint32_t)h << 16); }

/* fp32 -> nearest bf16 (ties to even), returned widened to fp32. */
static inline float rb(float x) {
    uint32_t u = bits_of(x);
    return from_bits(((u + 0x7fffu + ((u << 15) >> 31)) >> 16) << 16);
}

static inline bf16 narrow(float rounded) { return (bf16)(bits_of(rounded) >> 16); }

/* The scalars of one step (eight_bit.Collage8bitAdamW: step_math.step_scalars). */
typedef struct {
    float one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bias2, eps, step_size, decay;
} scalars_t;

/* The two maps and their search tables, built and checked by eight_bit_kernel.py. */
#define CELL_ROWS 25    /* exponents 104..127 and one row for everything below */
#define CELL_EXP0 104u  /* the first exponent with a row of its own */
#define CELLS (2 * CELL_ROWS * 128)
typedef struct {
    const float *m_code;    /* 256 signed codes */
    const float *m_mid;     /* their 255 midpoints, then +inf */
    const float *v_code;    /* 256 unsigned codes, then +inf */
    /* per cell: the least count of m's midpoints below x (bits 0-7) and of v's codes at
     * or below x, at most 255 (bits 8-15); 32-bit words, which vector gathers load */
    const int32_t *cells;
} maps_t;

static inline int cell_of(float x) {
    const uint32_t u = bits_of(x), e = (u >> 23) & 0xffu;
    uint32_t row = e >= CELL_EXP0 ? e - CELL_EXP0 + 1 : 0;
    row = row < CELL_ROWS ? row : CELL_ROWS - 1; /* only NaN or |x| > 1 get here */
    return (int)(((u >> 31) * CELL_ROWS + row) * 128 + ((u >> 16) & 0x7fu));
}

/* lowbias32 (rounding_noise.mix32). */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* clamp(x, -1, 1) as torch.clamp: max with the lower bound, then min with the upper. */
static inline float clamp1(float x) {
    x = x < -1.0f ? -1.0f : x;
    return x > 1.0f ? 1.0f : x;
}

/* Blocks longer than this step eagerly (eight_bit_kernel.MAX_BLOCK). */
#define MAX_BLOCK 4096
static const float TINY = 1e-38f; /* blockwise8._scaled's clamp, an fp32 subnormal */

/* The index of the code nearest to x (blockwise8.quantize's bucketize: ties go to the
 * lower code): the cell's least count of midpoints below x, plus one if the next is too. */
static inline __attribute__((always_inline)) int nearest_m(float x, const maps_t *maps) {
    const int k = maps->cells[cell_of(x)] & 0xff;
    return k + (maps->m_mid[k] < x);
}

/* The clamp of a scaled v (>= +0) to 1, on the bits: a float select here keeps gcc 12
 * from vectorising the loop. */
static inline float clamp_v(float x) {
    const uint32_t u = bits_of(x);
    return from_bits(u < 0x3f800000u ? u : 0x3f800000u);
}

/* The stochastically rounded index of x in [0, 1] (blockwise8.quantize with noise and
 * keep_nonzero): x between codes c_k <= x <= c_k+1 (k = searchsorted - 1, clamped to
 * 0..254) rounds up when noise < (x - c_k) / (c_k+1 - c_k); a positive x never gets 0. */
static inline __attribute__((always_inline)) int rounded_v(float x, float noise,
                                                           const maps_t *maps) {
    const float *code = maps->v_code;
    int k = (maps->cells[cell_of(x)] >> 8) & 0xff;
    k += code[k] <= x; /* codes <= x */
    int below = k - 1;
    below = below < 0 ? 0 : (below > 254 ? 254 : below);
    const float low = code[below], high = code[below + 1];
    const int index = below + (noise < (x - low) / (high - low));
    /* x > 0 on its bits (positive, finite): a float compare here also keeps gcc from
     * vectorising */
    const int least = bits_of(x) - 1u < 0x7f800000u;
    return index > least ? index : least;
}

/* rounding_noise.uniform of the element's random_bits (index i, modulo 2^32). */
static inline float uniform(uint32_t i, uint32_t key1, uint32_t key2) {
    const uint32_t bits = mix32(mix32(i ^ key1) ^ key2);
    return (float)(bits >> 8) * 0x1p-24f;
}

/* Quantise one block: whole (1) multiplies by the reciprocals m_by and v_by, a shorter
 * block (0) divides by its absmaxes m_by and v_by (blockwise8._scaled). m and v in two
 * loops: one loop with both does not vectorise (gcc 12). */
static inline __attribute__((always_inline)) void quantise(
    const int whole, int64_t len, const float *m_new, const float *v_new, float m_by,
    float v_by, uint32_t first, uint32_t key1, uint32_t key2, const maps_t *maps, uint8_t *mq,
    uint8_t *vq) {
#pragma omp simd
    for (int64_t i = 0; i < len; i++)
        mq[i] = (uint8_t)nearest_m(clamp1(whole ? m_new[i] * m_by : m_new[i] / m_by), maps);
#pragma omp simd
    for (int64_t i = 0; i < len; i++) {
        const float x = clamp_v(whole ? v_new[i] * v_by : v_new[i] / v_by);
        vq[i] = (uint8_t)rounded_v(x, uniform(first + (uint32_t)i, key1, key2), maps);
    }
}

/* The searches alone, for the tests: m_index[i] = nearest_m(clamp(x[i], -1, 1)) and, for
 * x[i] >= +0 (a scaled v never has its sign bit set), v_index[i] = rounded_v(min(x[i], 1),
 * noise[i]), else -1. */
void collage8_search(int64_t n, const float *x, const float *noise, const maps_t *maps,
                     int32_t *m_index, int32_t *v_index) {
    for (int64_t i = 0; i < n; i++) {
        m_index[i] = nearest_m(clamp1(x[i]), maps);
        v_index[i] = bits_of(x[i]) >> 31 ? -1 : rounded_v(clamp_v(x[i]), noise[i], maps);
    }
}

/* The step on n elements (whole blocks of `block`, the last possibly shorter: the end
 * of the tensor) whose first is element `offset` of its tensor (the index its random
 * bits are drawn for). With track, the six EDQ partial sums of each of `rows` ranges
 * [bounds[2r], bounds[2r + 1]) (relative to this range) are added to sums[6r..6r+5]. */
static inline __attribute__((always_inline)) void step_blocks(
    const int track, int64_t n, int64_t block, int64_t offset, uint32_t key1, uint32_t key2,
    bf16 *theta, bf16 *dtheta, uint8_t *m_q, float *m_absmax, uint8_t *v_q, float *v_absmax,
    const bf16 *grad, const scalars_t *c, const maps_t *maps, int64_t rows,
    const int64_t *bounds, double *sums) {
    float m_new[MAX_BLOCK] __attribute__((aligned(64)));
    float v_new[MAX_BLOCK] __attribute__((aligned(64)));
    float upd[MAX_BLOCK] __attribute__((aligned(64)));
    float realised[MAX_BLOCK] __attribute__((aligned(64)));
    float low[MAX_BLOCK] __attribute__((aligned(64)));
    const float omb1 = c->one_minus_beta1, beta2 = c->beta2, omb2 = c->one_minus_beta2,
                isb2 = c->inv_sqrt_bias2, eps = c->eps, step_size = c->step_size,
                decay = c->decay;
    const float *m_code = maps->m_code, *v_code = maps->v_code;
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        const int64_t len = start + block < n ? block : n - start;
        const float m_scale = m_absmax[b], v_scale = v_absmax[b];
        bf16 *th_p = theta + start, *dth_p = dtheta + start;
        uint8_t *mq = m_q + start, *vq = v_q + start;
        const bf16 *g_p = grad + start;
        float m_max = 0.0f, v_max = 0.0f;
#pragma omp simd reduction(max : m_max, v_max)
        for (int64_t i = 0; i < len; i++) {
            const float g = widen(g_p[i]);
            const float m_old = m_code[mq[i]] * m_scale, v_old = v_code[vq[i]] * v_scale;
            const float m = m_old + omb1 * (g - m_old);
            const float v = v_old * beta2 + omb2 * (g * g);
            const float denom = sqrtf(v) * isb2 + eps;
            const float th = widen(th_p[i]), dth = widen(dth_p[i]);
            const float u = rb((m / denom) * step_size + decay * th);
            /* mcf.grow: TwoSum of theta and u, its error into dtheta, Fast2Sum. TwoSum's
             * last four roundings are exact for bf16 operands and are left out, as in
             * cpu_kernel.c (tests/optim/exhaustive_two_sum.c checks every pair). */
            const float s = rb(th + u);
            const float a_approx = rb(s - u);
            const float b_approx = s - a_approx;
            const float t = (th - a_approx) + (u - b_approx);
            const float d = rb(dth + t);
            const float value = rb(s + d);
            const float remainder = rb(d - rb(value - s));
            th_p[i] = narrow(value);
            dth_p[i] = narrow(remainder);
            m_new[i] = m;
            v_new[i] = v;
            if (track) {
                upd[i] = u;
                realised[i] = value - th;
                low[i] = remainder;
            }
            const float am = fabsf(m), av = fabsf(v);
            m_max = am > m_max ? am : m_max;
            v_max = av > v_max ? av : v_max;
        }
        if (track) {
            for (int64_t r = 0; r < rows; r++) {
                const int64_t lo = bounds[2 * r] > start ? bounds[2 * r] - start : 0;
                const int64_t hi = bounds[2 * r + 1] - start < len ? bounds[2 * r + 1] - start : len;
                if (lo >= hi) continue;
                float s0 = 0, s1 = 0, s4 = 0, s5 = 0;
                int32_t n2 = 0, n3 = 0;
#pragma omp simd reduction(+ : s0, s1, n2, n3, s4, s5)
                for (int64_t i = lo; i < hi; i++) {
                    const float u = upd[i], d = realised[i], l = low[i];
                    s0 += d * u;
                    s1 += u * u;
                    n2 += u != 0.0f;
                    n3 += (u != 0.0f) & (d == 0.0f);
                    s4 += l * l;
                    s5 += l * u;
                }
                double *row = sums + 6 * r;
                row[0] += s0, row[1] += s1, row[2] += n2, row[3] += n3, row[4] += s4,
                    row[5] += s5;
            }
        }
        /* blockwise8._scaled: a whole block scales by a reciprocal and keeps its absmax
         * as it is; a shorter (last) one divides by its absmax kept at TINY or more. */
        const int whole = len == block;
        const float m_keep = whole ? m_max : (m_max > TINY ? m_max : TINY);
        const float v_keep = whole ? v_max : (v_max > TINY ? v_max : TINY);
        const float m_div = m_max > TINY ? m_max : TINY, v_div = v_max > TINY ? v_max : TINY;
        const float m_rcp = 1.0f / m_div, v_rcp = 1.0f / v_div;
        m_absmax[b] = m_keep;
        v_absmax[b] = v_keep;
        const uint32_t first = (uint32_t)(offset + start);
        if (whole)
            quantise(1, len, m_new, v_new, m_rcp, v_rcp, first, key1, key2, maps, mq, vq);
        else
            quantise(0, len, m_new, v_new, m_div, v_div, first, key1, key2, maps, mq, vq);
    }
}

/* keep: NULL, or one byte (a bool tensor's) that, when 0, makes the step change nothing
   (the caller's zeroed sums stay zero). */
void collage8_step(int64_t n, int64_t block, int track, int64_t offset, uint32_t key1,
                   uint32_t key2, bf16 *theta, bf16 *dtheta, uint8_t *m_q, float *m_absmax,
                   uint8_t *v_q, float *v_absmax, const bf16 *grad, const scalars_t *c,
                   const maps_t *maps, int64_t rows, const int64_t *bounds, double *sums,
                   const uint8_t *keep) {
    if (keep != NULL && *keep == 0) return;
    if (track)
        step_blocks(1, n, block, offset, key1, key2, theta, dtheta, m_q, m_absmax, v_q,
                    v_absmax, grad, c, maps, rows, bounds, sums);
    else
        step_blocks(0, n, block, offset, key1, key2, theta, dtheta, m_q, m_absmax, v_q,
                    v_absmax, grad, c, maps, rows, bounds, sums);
}
