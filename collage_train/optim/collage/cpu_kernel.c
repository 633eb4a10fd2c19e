/* The CollageAdamW step on one contiguous range of bf16 tensors, for CPUs.
 *
 * The same arithmetic as step_math.collage_tensor_step, element for element: fp32
 * operations on widened bf16 values, each result that the reference rounds to bf16
 * rounded here to nearest-even on its bits (rb). Compiled by cpu_kernel.py with
 * -O3 -march=native -ffp-contract=off: no fused multiply-adds (every product is rounded
 * to fp32 on its own, as in the reference), no reassociation, IEEE division and sqrt;
 * "#pragma omp simd" (with -fopenmp-simd, no OpenMP runtime) lets the compiler
 * vectorise the loops, EDQ sums included.
 *
 * The step is bound by the processor's vector ports, not by memory: a bf16 rounding is
 * five integer operations and the plus step needs 37 of them per element. Five things
 * cut the operation count without changing a bit of the result:
 *
 * 1. Roundings known to be exact are not done. TwoSum (mcf.two_sum) rounds six
 *    results; only the first two can be inexact, the other four are exact for every
 *    pair of bf16 inputs (tests/optim/exhaustive_two_sum.c checks all 2^32 pairs; it is also
 *    the theorem of Boldo, Graillat and Muller 2017).
 * 2. Roundings that are exact in practice are checked instead of done. A rounding of
 *    an fp32 value whose low 16 bits are zero returns it unchanged, so the fast paths
 *    keep such values as they are and OR their bits into a word; if that word's low
 *    16 bits are zero at the end of a block, every skipped rounding was the identity.
 *    They are Fast2Sum's two (exact when the first operand is the larger, which an MCF
 *    renormalisation of a value and its remainder always is) and the error of a
 *    product of two bf16 (exact outside the subnormal range).
 * 3. The remaining roundings are three floating-point operations instead of five
 *    integer ones (SPLIT, x86 only): Veltkamp's splitting, h = c - (c - x) with
 *    c = x * (2^16 + 1), is x rounded to 8 significant bits, ties to even, for every
 *    normal fp32 x below 2^111. Where it is not, x is subnormal, or c overflows, or x
 *    is infinite, and the processor says so: the product raises the denormal-operand
 *    flag or the overflow flag, inf - inf the invalid flag (tests/optim/exhaustive_split.c
 *    checks all 2^32 inputs: rb's bits or a flag). The kernel reads those sticky MXCSR
 *    flags after a block and hands the block on if any is set. A quiet NaN x gives
 *    h = x, as rb does for the NaNs this kernel sees (see below); a signalling one
 *    raises the invalid flag.
 * 4. The fast paths read and write the bf16 arrays as pairs in 32-bit words: the low
 *    half widened by a shift, the high half by a mask, and packed back with a shift and
 *    a select, instead of the widening and narrowing shuffles of one element at a time.
 * 5. With beta2_hi == 1 (beta2 >= 0.998) four roundings of mcf.mul are of bf16 values
 *    and are left out (scaled_v, unit_hi).
 *
 * So there are three tiers, tried block by block (1024 elements): SPLIT (2. to 5.),
 * CHECKED (the integer rounding, 2. and 4. and 5.) and EXACT (every rounding done, one
 * element at a time, in place). The fast tiers write their results to block-local
 * buffers and only a block that passes its checks copies them out, so a block handed
 * to the next tier starts from untouched state. Mode none leaves nothing out and has
 * one fast tier, CHECKED with nothing to check, which writes in place.
 *
 * The fast tiers compute plus mode's second moment in two loops through the buffers,
 * the first to mcf.mul's result, the second its grow (scaled_v): SPLIT's roundings are
 * 12 cycles of latency instead of about 4, and two shorter dependency chains keep more
 * elements in flight.
 *
 * On a 2-core AVX-512 host the plus step's fast loops are 296 vector instructions per
 * 32 elements with SPLIT (278 with beta2_hi == 1), 383 with CHECKED, 463 rounding
 * everything; the EDQ sums add 27.
 *
 * NaN: rb keeps a NaN a NaN without the explicit test torch's conversion makes. Every
 * NaN in this kernel is a widened bf16 NaN or the processor's default NaN, whose low 16
 * bits are zero, so adding the rounding bias cannot carry into the exponent (and the
 * check of 2. passes it through). The payload may differ from torch's (which itself
 * differs between its vector and scalar paths).
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
    /* The even bit as (u << 15) >> 31: written as (u >> 16) & 1, gcc turns it into a
     * compare and a masked move (6 vector ops instead of 5). */
    return from_bits(((u + 0x7fffu + ((u << 15) >> 31)) >> 16) << 16);
}

/* The bf16 bits of a value already rounded by rb. */
static inline bf16 narrow(float rounded) { return (bf16)(bits_of(rounded) >> 16); }

/* The tiers (see the top of the file). */
enum { EXACT = 0, CHECKED = 1, SPLIT = 2 };

/* A rounding: Veltkamp's splitting on the SPLIT tier (checked by the MXCSR flags),
 * rb on the others. */
static inline float round_bf16(const int tier, float x) {
    if (tier != SPLIT) return rb(x);
    const float c = x * 65537.0f;
    return c - (c - x);
}

/* A rounding that is exact in practice: checked (its bits ORed into *low) on the fast
 * tiers, done on the exact one. */
static inline float checked_rb(const int tier, float x, uint32_t *low) {
    if (tier == EXACT) return rb(x);
    *low |= bits_of(x);
    return x;
}

/* The MXCSR flags that say a SPLIT rounding may be wrong (invalid, denormal operand,
 * overflow), and the control bits it needs (all exceptions masked, round to nearest,
 * no flush-to-zero, no denormals-are-zero). */
#define SPLIT_FLAGS 0x0bu
#define CONTROL_BITS 0xffc0u
#define DEFAULT_CONTROL 0x1f80u

#if defined(__x86_64__) && !defined(COLLAGE_NO_SPLIT)
#define HAVE_SPLIT 1
/* The "memory" clobbers order them after every store before and before every load
 * after: a block's arithmetic, which all ends in stores, cannot move across them. */
static inline uint32_t read_csr(void) {
    uint32_t csr;
    __asm__ volatile("stmxcsr %0" : "=m"(csr) : : "memory");
    return csr;
}
static inline void write_csr(uint32_t csr) {
    __asm__ volatile("ldmxcsr %0" : : "m"(csr) : "memory");
}
#else
#define HAVE_SPLIT 0
static inline uint32_t read_csr(void) { return 0; }
static inline void write_csr(uint32_t csr) { (void)csr; }
#endif

/* The tests' exhaustive checks (tests/exhaustive_*.c) include this file for the roundings
 * above and define COLLAGE_ROUNDINGS_ONLY: the step itself is not compiled for them. */
#ifndef COLLAGE_ROUNDINGS_ONLY

/* Two adjacent bf16 elements as one 32-bit word (any alignment), and back. */
static inline uint32_t load_pair(const bf16 *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}
static inline void store_pair(bf16 *p, uint32_t w) { memcpy(p, &w, 4); }
static inline float low_half(uint32_t w) { return from_bits(w << 16); }
static inline float high_half(uint32_t w) { return from_bits(w & 0xffff0000u); }
static inline uint32_t pack(float low_rounded, float high_rounded) {
    return (bits_of(high_rounded) & 0xffff0000u) | (bits_of(low_rounded) >> 16);
}

/* The scalars of one step, in the order of step_math.step_scalars (plus 1 - beta2). */
typedef struct {
    float one_minus_beta1, beta2, beta2_hi, beta2_lo, one_minus_beta2, inv_sqrt_bias2, eps,
        step_size, decay;
} scalars_t;

/* ------------------------------------------------------------------------------------
 * The arithmetic of one element, shared by the tiers. mode: 0 none (bf16), 1 light,
 * 2 plus. */

/* round_bf16 on the tier of the function it is used in. */
#define R(x) round_bf16(tier, (x))

/* An MCF (value, remainder) pair. */
typedef struct {
    float value, remainder;
} mcf_t;

/* mcf.grow((x, dx), y): TwoSum of x and y, its error added to the remainder, and the
 * result renormalised with Fast2Sum (whose two roundings are checked on the fast tiers). */
static inline __attribute__((always_inline)) mcf_t grow(const int tier, float x, float dx,
                                                          float y, uint32_t *low) {
    const float s = R(x + y);
    const float a_approx = R(s - y);
    const float b_approx = s - a_approx; /* exact: 1. */
    const float t = (x - a_approx) + (y - b_approx);
    const float d = R(dx + t);
    mcf_t r;
    r.value = R(s + d);
    r.remainder = checked_rb(tier, d - checked_rb(tier, r.value - s, low), low);
    return r;
}

/* The first moment: fl(m + (1 - beta1) * (g - m)). */
static inline __attribute__((always_inline)) float new_m(const int tier, float g, float ea,
                                                         const scalars_t *c) {
    return R(ea + c->one_minus_beta1 * (g - ea));
}

/* Plus mode's second moment in two halves, so that a fast tier can run each in its own
 * loop (two shorter dependency chains keep more elements in flight). The first half:
 * (s, t) = mcf.mul((v, dv), (beta2_hi, beta2_lo)) and y = fl(fl(g^2) * (1 - beta2));
 * the second is grow(s, t, y), the new (v, dv). */
typedef struct {
    float s, t, y;
} scaled_v_t;

static inline __attribute__((always_inline)) scaled_v_t
scaled_v(const int tier, const int unit_hi, float g, float x, float dx, const scalars_t *c,
         uint32_t *low) {
    /* unit_hi: beta2_hi == 1 (beta2 >= 0.998, the usual 0.999), where x * hi and dx * hi
     * are bf16 values, x * hi - p is 0 (or NaN) and adding it leaves a bf16 value: four
     * roundings that are the identity. */
    const float p = unit_hi ? x * c->beta2_hi : R(x * c->beta2_hi);
    const float error = x * c->beta2_hi - p; /* exact outside the subnormal range */
    const float e = unit_hi ? error : checked_rb(tier, error, low);
    const float dx_hi = unit_hi ? dx * c->beta2_hi : R(dx * c->beta2_hi);
    const float d_unrounded = R(dx_hi + R(x * c->beta2_lo)) + e;
    const float d = unit_hi ? d_unrounded : R(d_unrounded);
    scaled_v_t r;
    r.s = R(p + d);
    r.t = checked_rb(tier, d - checked_rb(tier, r.s - p, low), low);
    r.y = R(R(g * g) * c->one_minus_beta2); /* g * g is exact in fp32 */
    return r;
}

/* Light mode's second moment: fl(fl(v * beta2) + (1 - beta2) * g^2). */
static inline __attribute__((always_inline)) float light_v(const int tier, float g, float x,
                                                           const scalars_t *c) {
    return R(R(x * c->beta2) + c->one_minus_beta2 * (g * g));
}

static inline __attribute__((always_inline)) float
intended_update(const int tier, float m, float v, float th, const scalars_t *c) {
    float denom = R(sqrtf(v));
    denom = R(R(denom * c->inv_sqrt_bias2) + c->eps);
    const float update = R(R(m / denom) * c->step_size);
    return R(update + c->decay * th);
}

typedef struct {
    float theta, dtheta;
} weights_t;

static inline __attribute__((always_inline)) weights_t
new_weights(const int mode, const int tier, float th, float dth, float update, uint32_t *low) {
    weights_t r = {0.0f, 0.0f};
    if (mode == 0) {
        r.theta = R(th + update);
        return r;
    }
    const mcf_t grown = grow(tier, th, dth, update, low); /* (theta, dtheta) + update */
    r.theta = grown.value;
    r.dtheta = grown.remainder;
    return r;
}

/* The six EDQ partial sums of collage_train.metrics.edq.FIELDS, per vector lane. Sums, not
 * results: fused multiply-adds are fine here (fewer ops). */
#define EDQ_ACCUMULATE(th, w, update)                                                         \
    do {                                                                                      \
        const float realised = (w).theta - (th);                                              \
        s0 = fmaf(realised, (update), s0);                                                    \
        s1 = fmaf((update), (update), s1);                                                    \
        n2 += (update) != 0.0f;                                                               \
        n3 += ((update) != 0.0f) & (realised == 0.0f);                                        \
        s4 = fmaf((w).dtheta, (w).dtheta, s4);                                                \
        s5 = fmaf((w).dtheta, (update), s5);                                                  \
    } while (0)

/* Elements per block: EDQ sums are accumulated in fp32 per block (vectorised), then in
 * double; a block is also the unit a tier checks and, on failure, hands on. A block of
 * the six arrays and the fast tiers' buffers take 38 KB, which fit this host's 48 KB L1. */
#define BLOCK 1024

/* ------------------------------------------------------------------------------------
 * The exact path: every rounding done, one element at a time, in place. Three loops
 * per block, each with a shorter dependency chain than one loop doing the whole step. */
static inline __attribute__((always_inline)) void exact_range(
    const int mode, const int track, const int keep_update, int64_t n, bf16 *theta,
    bf16 *dtheta, bf16 *exp_avg, bf16 *exp_avg_sq, bf16 *dv, const bf16 *grad,
    bf16 *update_out, const scalars_t *c, double *acc) {
    float intended[BLOCK] __attribute__((aligned(64)));
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
#pragma omp simd
        for (int64_t i = start; i < end; i++) {
            uint32_t unused = 0;
            const float g = widen(grad[i]), v = widen(exp_avg_sq[i]);
            exp_avg[i] = narrow(new_m(EXACT, g, widen(exp_avg[i]), c));
            if (mode == 2) {
                const scaled_v_t h = scaled_v(EXACT, 0, g, v, widen(dv[i]), c, &unused);
                const mcf_t r = grow(EXACT, h.s, h.t, h.y, &unused); /* the new (v, dv) */
                exp_avg_sq[i] = narrow(r.value);
                dv[i] = narrow(r.remainder);
            } else {
                exp_avg_sq[i] = narrow(light_v(EXACT, g, v, c));
            }
        }
#pragma omp simd
        for (int64_t i = start; i < end; i++)
            intended[i - start] =
                intended_update(EXACT, widen(exp_avg[i]), widen(exp_avg_sq[i]), widen(theta[i]), c);
        float s0 = 0, s1 = 0, s4 = 0, s5 = 0;
        int32_t n2 = 0, n3 = 0;
#pragma omp simd reduction(+ : s0, s1, n2, n3, s4, s5)
        for (int64_t i = start; i < end; i++) {
            uint32_t unused = 0;
            const float th = widen(theta[i]), update = intended[i - start];
            const weights_t w =
                new_weights(mode, EXACT, th, mode ? widen(dtheta[i]) : 0.0f, update, &unused);
            if (track) EDQ_ACCUMULATE(th, w, update);
            if (keep_update) update_out[i] = narrow(update);
            theta[i] = narrow(w.theta);
            if (mode) dtheta[i] = narrow(w.dtheta);
        }
        acc[0] += s0, acc[1] += s1, acc[2] += n2, acc[3] += n3, acc[4] += s4, acc[5] += s5;
    }
}

/* ------------------------------------------------------------------------------------
 * A fast tier (CHECKED or SPLIT) on one block of 2 * pairs elements: results into the
 * buffers, then, if every check passed, copied out, the block's sums added to acc and 1
 * returned; otherwise 0, with nothing written but update_out (which the next tier
 * overwrites). Mode none, which checks nothing, writes in place. SPLIT expects the
 * MXCSR flags clear when it starts. */
typedef struct {
    bf16 m[BLOCK], v[BLOCK], dv[BLOCK], theta[BLOCK], dtheta[BLOCK];
    float update_low[BLOCK / 2], update_high[BLOCK / 2];
    /* scaled_v's results, one array per field and half (not an array of structs, which
     * the vectoriser would interleave with permutes). */
    float s_low[BLOCK / 2], t_low[BLOCK / 2], y_low[BLOCK / 2];
    float s_high[BLOCK / 2], t_high[BLOCK / 2], y_high[BLOCK / 2];
} buffers_t;

/* Whether a block's checks failed: a checked rounding that was not the identity, or on
 * SPLIT a flag saying a split rounding may be wrong. */
static inline int failed(const int tier, uint32_t low) {
    return (low & 0xffffu) || (tier == SPLIT && (read_csr() & SPLIT_FLAGS));
}

static inline __attribute__((always_inline)) int fast_block(
    const int mode, const int tier, const int unit_hi, const int track, const int keep_update,
    int64_t pairs, bf16 *theta, bf16 *dtheta, bf16 *exp_avg, bf16 *exp_avg_sq, bf16 *dv,
    const bf16 *grad, bf16 *update_out, const scalars_t *c, double *acc, buffers_t *b) {
    /* Mode none leaves no rounding out: nothing to check, so it writes in place. */
    const int in_place = mode == 0;
    bf16 *m_to = in_place ? exp_avg : b->m, *v_to = in_place ? exp_avg_sq : b->v,
         *theta_to = in_place ? theta : b->theta;
    uint32_t low = 0;
    if (mode == 2) {
        /* Plus: the second moment in two loops (see scaled_v), through the buffers. */
#pragma omp simd reduction(| : low)
        for (int64_t j = 0; j < pairs; j++) {
            const uint32_t g = load_pair(grad + 2 * j), m = load_pair(exp_avg + 2 * j),
                           v = load_pair(exp_avg_sq + 2 * j), dvw = load_pair(dv + 2 * j);
            uint32_t l = 0;
            store_pair(m_to + 2 * j, pack(new_m(tier, low_half(g), low_half(m), c),
                                          new_m(tier, high_half(g), high_half(m), c)));
            const scaled_v_t lo =
                scaled_v(tier, unit_hi, low_half(g), low_half(v), low_half(dvw), c, &l);
            const scaled_v_t hi =
                scaled_v(tier, unit_hi, high_half(g), high_half(v), high_half(dvw), c, &l);
            b->s_low[j] = lo.s, b->t_low[j] = lo.t, b->y_low[j] = lo.y;
            b->s_high[j] = hi.s, b->t_high[j] = hi.t, b->y_high[j] = hi.y;
            low |= l;
        }
#pragma omp simd reduction(| : low)
        for (int64_t j = 0; j < pairs; j++) {
            uint32_t l = 0;
            const mcf_t lo = grow(tier, b->s_low[j], b->t_low[j], b->y_low[j], &l);
            const mcf_t hi = grow(tier, b->s_high[j], b->t_high[j], b->y_high[j], &l);
            store_pair(v_to + 2 * j, pack(lo.value, hi.value));
            store_pair(b->dv + 2 * j, pack(lo.remainder, hi.remainder));
            low |= l;
        }
    } else {
#pragma omp simd
        for (int64_t j = 0; j < pairs; j++) {
            const uint32_t g = load_pair(grad + 2 * j), m = load_pair(exp_avg + 2 * j),
                           v = load_pair(exp_avg_sq + 2 * j);
            store_pair(m_to + 2 * j, pack(new_m(tier, low_half(g), low_half(m), c),
                                          new_m(tier, high_half(g), high_half(m), c)));
            store_pair(v_to + 2 * j, pack(light_v(tier, low_half(g), low_half(v), c),
                                          light_v(tier, high_half(g), high_half(v), c)));
        }
    }
    if (failed(tier, low)) return 0;
#pragma omp simd
    for (int64_t j = 0; j < pairs; j++) {
        const uint32_t th = load_pair(theta + 2 * j), m = load_pair(m_to + 2 * j),
                       v = load_pair(v_to + 2 * j);
        const float ulo = intended_update(tier, low_half(m), low_half(v), low_half(th), c);
        const float uhi = intended_update(tier, high_half(m), high_half(v), high_half(th), c);
        b->update_low[j] = ulo;
        b->update_high[j] = uhi;
        if (keep_update) store_pair(update_out + 2 * j, pack(ulo, uhi));
    }
    float s0 = 0, s1 = 0, s4 = 0, s5 = 0;
    int32_t n2 = 0, n3 = 0;
#pragma omp simd reduction(+ : s0, s1, n2, n3, s4, s5) reduction(| : low)
    for (int64_t j = 0; j < pairs; j++) {
        const uint32_t th = load_pair(theta + 2 * j), dth = mode ? load_pair(dtheta + 2 * j) : 0;
        const float ulo = b->update_low[j], uhi = b->update_high[j];
        uint32_t l = 0;
        const weights_t wlo = new_weights(mode, tier, low_half(th), low_half(dth), ulo, &l);
        const weights_t whi = new_weights(mode, tier, high_half(th), high_half(dth), uhi, &l);
        if (track) {
            EDQ_ACCUMULATE(low_half(th), wlo, ulo);
            EDQ_ACCUMULATE(high_half(th), whi, uhi);
        }
        store_pair(theta_to + 2 * j, pack(wlo.theta, whi.theta));
        if (mode) store_pair(b->dtheta + 2 * j, pack(wlo.dtheta, whi.dtheta));
        low |= l;
    }
    if (failed(tier, low)) return 0;
    if (!in_place) {
        const size_t bytes = (size_t)pairs * 4;
        memcpy(exp_avg, b->m, bytes);
        memcpy(exp_avg_sq, b->v, bytes);
        if (mode == 2) memcpy(dv, b->dv, bytes);
        memcpy(theta, b->theta, bytes);
        memcpy(dtheta, b->dtheta, bytes);
    }
    acc[0] += s0, acc[1] += s1, acc[2] += n2, acc[3] += n3, acc[4] += s4, acc[5] += s5;
    return 1;
}

/* p + k, or NULL for an array the mode does not have. */
static inline bf16 *at(bf16 *p, int64_t k) { return p ? p + k : NULL; }

/* The step on n elements, block by block: SPLIT where it may run (split), then CHECKED,
 * then EXACT, each for the blocks the one before fails, and EXACT for an odd last
 * element. Counts the blocks handed to CHECKED and to EXACT into handed[0] and [1]. */
static inline __attribute__((always_inline)) void step_range(
    const int variant, const int track, const int keep_update, const int split, int64_t n,
    bf16 *theta, bf16 *dtheta, bf16 *exp_avg, bf16 *exp_avg_sq, bf16 *dv, const bf16 *grad,
    bf16 *update_out, const scalars_t *c, double *sums, int64_t *handed) {
    const int mode = variant == 3 ? 2 : variant, unit_hi = variant == 3;
    double acc[6] = {0, 0, 0, 0, 0, 0};
    buffers_t buffers __attribute__((aligned(64)));
    const int64_t even = n & ~(int64_t)1;
    for (int64_t start = 0; start < even; start += BLOCK) {
        const int64_t count = start + BLOCK < even ? BLOCK : even - start;
        bf16 *th = theta + start, *dt = at(dtheta, start), *m = exp_avg + start,
             *v = exp_avg_sq + start, *dvs = at(dv, start), *up = at(update_out, start);
        const bf16 *g = grad + start;
        if (split && mode) {
            const uint32_t csr = read_csr();
            if (csr & SPLIT_FLAGS) write_csr(csr & ~SPLIT_FLAGS);
            if (fast_block(mode, SPLIT, unit_hi, track, keep_update, count / 2, th, dt, m, v,
                           dvs, g, up, c, acc, &buffers))
                continue;
            handed[0]++;
        }
        if (fast_block(mode, CHECKED, unit_hi, track, keep_update, count / 2, th, dt, m, v,
                       dvs, g, up, c, acc, &buffers))
            continue;
        handed[1]++;
        exact_range(mode, track, keep_update, count, th, dt, m, v, dvs, g, up, c, acc);
    }
    if (n > even) /* the odd last element */
        exact_range(mode, track, keep_update, 1, theta + even, at(dtheta, even),
                    exp_avg + even, exp_avg_sq + even, at(dv, even), grad + even,
                    at(update_out, even), c, acc);
    if (track)
        for (int i = 0; i < 6; i++) sums[i] = acc[i];
}

/* One specialisation per (mode, output): the branches above fold away in each. Mode 3
 * is plus with beta2_hi == 1. */
#define VARIANT(MODE, TRACK, KEEP)                                                            \
    static void step_##MODE##TRACK##KEEP(int split, int64_t n, bf16 *theta, bf16 *dtheta,    \
                                         bf16 *m, bf16 *v, bf16 *dv, const bf16 *g,          \
                                         bf16 *update, const scalars_t *c, double *sums,     \
                                         int64_t *handed) {                                  \
        step_range(MODE, TRACK, KEEP, split, n, theta, dtheta, m, v, dv, g, update, c, sums, \
                   handed);                                                                  \
    }
VARIANT(0, 0, 0) VARIANT(0, 1, 0) VARIANT(0, 0, 1)
VARIANT(1, 0, 0) VARIANT(1, 1, 0) VARIANT(1, 0, 1)
VARIANT(2, 0, 0) VARIANT(2, 1, 0) VARIANT(2, 0, 1)
VARIANT(3, 0, 0) VARIANT(3, 1, 0) VARIANT(3, 0, 1)

typedef void (*variant_t)(int, int64_t, bf16 *, bf16 *, bf16 *, bf16 *, bf16 *, const bf16 *,
                          bf16 *, const scalars_t *, double *, int64_t *);
static const variant_t VARIANTS[4][3] = {{step_000, step_010, step_001},
                                         {step_100, step_110, step_101},
                                         {step_200, step_210, step_201},
                                         {step_300, step_310, step_301}};

/* mode: 0 none, 1 light, 2 plus. out: 0 nothing, 1 the six EDQ sums into sums[0..5],
 * 2 the intended update into update (callers that split the sums do it themselves).
 * handed[0] and [1] get the number of blocks handed from SPLIT to CHECKED and to EXACT
 * (a diagnostic). SPLIT runs only with MXCSR's default control bits (round to nearest,
 * no flush-to-zero); the kernel leaves MXCSR as it found it. */
/* keep: NULL, or one byte (a bool tensor's) that, when 0, makes the step change nothing
   (the caller's zeroed sums and update stay zero). */
void collage_step(int64_t n, int mode, int out, bf16 *theta, bf16 *dtheta, bf16 *exp_avg,
                  bf16 *exp_avg_sq, bf16 *dv, const bf16 *grad, bf16 *update,
                  const scalars_t *c, double *sums, int64_t *handed, const uint8_t *keep) {
    const int variant = mode == 2 && c->beta2_hi == 1.0f ? 3 : mode;
    handed[0] = handed[1] = 0;
    if (keep != NULL && *keep == 0) return;
    const uint32_t csr = read_csr();
    const int split = HAVE_SPLIT && (csr & CONTROL_BITS) == DEFAULT_CONTROL;
    VARIANTS[variant][out](split, n, theta, dtheta, exp_avg, exp_avg_sq, dv, grad, update, c,
                           sums, handed);
    if (HAVE_SPLIT) write_csr(csr);
}

#endif /* COLLAGE_ROUNDINGS_ONLY */
