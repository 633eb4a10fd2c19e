/* TwoSum on every pair of bf16 values: the four roundings cpu_kernel.c skips are exact.
 *
 * Built and run by tests/test_collage_cpu_kernel.py with the kernel's own flags. For all
 * 2^32 pairs (x, a) of bf16 bit patterns it computes TwoSum as mcf.two_sum does (every
 * result rounded to bf16 by the kernel's rb) and as the kernel does (the last four
 * results not rounded), and counts the pairs whose (b', t) differ in any bit. NaN inputs
 * are left out: with two NaN operands the compiler may swap a commutative add and
 * return the other NaN's payload, in both versions alike. Prints the count and the
 * number of x done (each with all 2^16 a); exit 0 iff the count is 0. With arguments
 * "k n" it does only the x whose bits are k modulo n: one of n slices run at once.
 */
#include <stdio.h>
#include <stdlib.h>

#define COLLAGE_ROUNDINGS_ONLY
#include "cpu_kernel.c"

int main(int argc, char **argv) {
    const uint32_t slice = argc > 2 ? (uint32_t)atoi(argv[1]) : 0;
    const uint32_t slices = argc > 2 ? (uint32_t)atoi(argv[2]) : 1;
    unsigned long long differing = 0, chunks = 0;
    for (uint32_t i = slice; i < 65536; i += slices) {
        chunks++;
        const float x = widen((bf16)i);
        uint32_t count = 0;
#pragma omp simd reduction(+ : count)
        for (uint32_t j = 0; j < 65536; j++) {
            const float a = widen((bf16)j);
            const float s = rb(x + a);
            const float a_approx = rb(s - a);
            const float b_rounded = rb(s - a_approx);
            const float t_rounded = rb(rb(x - a_approx) + rb(a - b_rounded));
            const float b_exact = s - a_approx;
            const float t_exact = (x - a_approx) + (a - b_exact);
            const int nan = (x != x) | (a != a);
            count += !nan && ((bits_of(b_exact) != bits_of(b_rounded)) |
                              (bits_of(t_exact) != bits_of(t_rounded)));
        }
        differing += count;
    }
    printf("%llu %llu\n", differing, chunks);
    return differing != 0;
}
