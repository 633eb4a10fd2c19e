/* The kernel's split rounding on every fp32 value: rb's result, or a flag raised.
 *
 * Built and run by tests/test_collage_cpu_kernel.py with the kernel's own flags (x86
 * only, where the SPLIT tier exists). For all 2^32 bit patterns x it computes the SPLIT
 * tier's rounding (Veltkamp's splitting) and rb, and counts the x where they differ in
 * any bit while none of the MXCSR flags the kernel checks (SPLIT_FLAGS) was raised by
 * that x's rounding. NaNs whose low 16 bits are set are left out: the kernel never
 * rounds one (see the top of cpu_kernel.c). The 2^16 values sharing their high 16 bits
 * are done as one vectorised chunk; a chunk with any difference is redone one value at
 * a time, each with its own flags. Prints the count and the number of chunks done;
 * exit 0 iff the count is 0. With arguments "k n" it does only the chunks whose high
 * 16 bits are k modulo n: one of n slices run at once.
 */
#include <stdio.h>
#include <stdlib.h>

#define COLLAGE_ROUNDINGS_ONLY
#include "cpu_kernel.c"

/* Values of the chunk whose split rounding differs from rb (vectorised). */
static uint32_t differences(uint32_t high) {
    uint32_t count = 0;
#pragma omp simd reduction(+ : count)
    for (uint32_t low = 0; low < 65536; low++) {
        const float x = from_bits(high << 16 | low);
        count += bits_of(round_bf16(SPLIT, x)) != bits_of(rb(x));
    }
    return count;
}

/* Whether the split rounding of x is rb's or raises a flag the kernel checks. */
static int caught(float x) {
    /* Volatile: no constant folding, and the store (so the arithmetic) comes before
     * read_csr, whose memory clobber orders it after every store. */
    volatile float input = x, rounded;
    write_csr(DEFAULT_CONTROL);
    rounded = round_bf16(SPLIT, input);
    const uint32_t flags = read_csr() & SPLIT_FLAGS;
    return flags || bits_of(rounded) == bits_of(rb(x));
}

int main(int argc, char **argv) {
    const uint32_t slice = argc > 2 ? (uint32_t)atoi(argv[1]) : 0;
    const uint32_t slices = argc > 2 ? (uint32_t)atoi(argv[2]) : 1;
    const uint32_t saved = read_csr();
    unsigned long long wrong = 0, chunks = 0;
    for (uint32_t high = slice; high < 65536; high += slices) {
        chunks++;
        if (!differences(high)) continue;
        for (uint32_t low = 0; low < 65536; low++) {
            const uint32_t u = high << 16 | low;
            const float x = from_bits(u);
            if (x != x && (u & 0xffffu)) continue;
            wrong += !caught(x);
        }
    }
    write_csr(saved);
    printf("%llu %llu\n", wrong, chunks);
    return wrong != 0;
}
