/* A float32 linear layer for a few rows (decoding steps) with oneDNN's per-element arithmetic.

   Each output element is the sum, block by block in order, of a sequential fused multiply-add
   chain over the block's inputs (each chain starting at zero), the bias added last:

       y[m, n] = ((chain(block 0) + chain(block 1)) + ...) + bias[n]

   An element's bits depend only on its row, its weights and `block`, never on how many rows or
   threads share the call: columns are split between threads, rows between tiles, and every tile
   computes the same chain. kvrag.kernels.linear checks, per layer shape, that this reproduces
   oneDNN's rows before it uses it.

   The weight is packed by the caller as panels of 16 columns: wp[(p * K + k) * 16 + j] is the
   weight of column p * 16 + j for input k (zero past the last column); `panels` is a multiple of 8.
*/
#include <immintrin.h>
#include <stdint.h>

#define PANEL 16

static inline __mmask16 tail_mask(long n0, long N) {
    long left = N - n0;
    return left >= PANEL ? (__mmask16)0xFFFF : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u));
}

/* rows r0..r0+R-1 (R = 4 or 1) over panels p0..p0+PP-1 */
#define TILE(R, PP)                                                                                   \
    static void tile_##R##_##PP(const float *x, long ldx, long K, const float *wp, long p0, long N,   \
                                const float *bias, float *y, long ldy, long block) {                  \
        for (long k0 = 0; k0 < K; k0 += block) {                                                      \
            long k1 = k0 + block < K ? k0 + block : K;                                                \
            __m512 acc[R][PP];                                                                        \
            for (int r = 0; r < R; r++)                                                               \
                for (int p = 0; p < PP; p++) acc[r][p] = _mm512_setzero_ps();                         \
            for (long k = k0; k < k1; k++) {                                                          \
                __m512 w[PP];                                                                         \
                for (int p = 0; p < PP; p++) w[p] = _mm512_loadu_ps(wp + ((p0 + p) * K + k) * PANEL); \
                for (int r = 0; r < R; r++) {                                                         \
                    __m512 xk = _mm512_set1_ps(x[r * ldx + k]);                                       \
                    for (int p = 0; p < PP; p++) acc[r][p] = _mm512_fmadd_ps(xk, w[p], acc[r][p]);    \
                }                                                                                     \
            }                                                                                         \
            for (int r = 0; r < R; r++)                                                               \
                for (int p = 0; p < PP; p++) {                                                        \
                    long n0 = (p0 + p) * PANEL;                                                       \
                    __mmask16 m = tail_mask(n0, N);                                                   \
                    if (!m) continue;                                                                 \
                    float *out = y + r * ldy + n0;                                                    \
                    __m512 v = acc[r][p];                                                             \
                    if (k0) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v);                      \
                    _mm512_mask_storeu_ps(out, m, v);                                                 \
                }                                                                                     \
        }                                                                                             \
        if (bias)                                                                                     \
            for (int r = 0; r < R; r++)                                                               \
                for (int p = 0; p < PP; p++) {                                                        \
                    long n0 = (p0 + p) * PANEL;                                                       \
                    __mmask16 m = tail_mask(n0, N);                                                   \
                    if (!m) continue;                                                                 \
                    float *out = y + r * ldy + n0;                                                    \
                    _mm512_mask_storeu_ps(out, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, out),         \
                                                                _mm512_maskz_loadu_ps(m, bias + n0)));  \
                }                                                                                     \
    }

TILE(4, 4)
TILE(1, 8)

/* y[M, N] = x[M, K] @ W^T (+ bias), W packed as above with `panels` panels; `threads` threads. */
void kvrag_rows_f32(const float *x, long M, long K, const float *wp, long panels, const float *bias,
                    float *y, long N, long block, int threads) {
    long groups = panels / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long g = 0; g < groups; g++) {
        long m = 0;
        for (; m + 4 <= M; m += 4) {
            tile_4_4(x + m * K, K, K, wp, g * 8, N, bias, y + m * N, N, block);
            tile_4_4(x + m * K, K, K, wp, g * 8 + 4, N, bias, y + m * N, N, block);
        }
        for (; m < M; m++) tile_1_8(x + m * K, K, K, wp, g * 8, N, bias, y + m * N, N, block);
    }
}
