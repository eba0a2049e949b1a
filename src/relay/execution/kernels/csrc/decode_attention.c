// Paged decode attention for CPUs: one query token per request over its KV pages.
//
// Flash-decoding: each (request, kv head, chunk of up to 512 tokens) is one work item that
// streams its keys and values once, page by page, for all query heads that share the kv head
// (GQA): every score of the chunk, one softmax pass, then the values (prefetched with the keys,
// so still in L2). A request's chunks are merged at the end by their log-sum-exp, so one long
// request still spreads over every thread.
// Work items are ordered by (kv head, first page, chunk, request): requests that share a
// prefix (the same first pages) run back to back on one thread and find its KV in cache.
//
// A chunk runs the two passes compiled for its shape: head_dim 64 or 128 with 1..8 query heads
// per kv head are instances of their own (the group and the vectors per row compile-time: queries
// and accumulators in registers), any other head_dim of whole vectors a runtime-shaped instance of
// the same code, with AVX-512's 16 lanes (its own kernels) or, at every other level (AVX2 + FMA,
// generic C), vec.h's VL lanes; a plain C loop with an online softmax per 16 keys takes the rest.
// Every head of a group scores against one read of a block of keys (a bfloat16 cache's widened
// once for all of them below AVX-512). Built at first use with the system C compiler for this
// CPU's level (relay.execution.kernels.isa) and loaded with ctypes (relay/execution/kernels/cpu.py); OpenMP resolves
// to the runtime torch already loaded, so torch's thread count and pool are shared.
//
// Attention beyond causal, per call (a layer's): a sliding window makes a request's work items
// start at its window's first key, so the pages before it are never read (the speed of a model
// whose layers slide: 512 keys a step instead of the whole context); a soft-cap bends the chunk's
// scores (cap * tanh(s / cap), in base 2 as the softmax) before its softmax pass, in every kernel.
//
// Layouts: q, out [B, H, D] (float32 or bfloat16, the same); k, v caches "HND" [HKV, S, D]
// (float32 or bfloat16); tables [B, P] int32 page ids; lens [B]; order [B] the requests in
// the order to visit them. Slot of token l of request b: tables[b, l / PS] * PS + l % PS.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16  // tokens whose scores are exponentiated together
#define MAX_GROUP 16  // query heads per kv head this kernel takes (the caller checks)
#define TWO_PASS_MAX 512  // keys of a work item the two-pass kernels take (a chunk: cpu.DECODE_CHUNK)
// How far apart the two-pass kernels keep each query head's scores: a run of a page's keys stores a
// whole vector (up to TILE lanes) from its first key on, so the last run of an item may write up to
// TILE - 1 past its end (with pages of fewer than TILE tokens, or an item that starts mid-page: a
// sliding window's), which must not reach the next head's first scores.
#define SCORE_STRIDE (TWO_PASS_MAX + TILE)

#include "vec.h"

// The next pages are somewhere else in the pool, where the hardware prefetcher does not look: a
// work item asks for the tiles PREFETCH_TILES ahead of the one it computes, into L2 (prefetcht1).
// Into L1 (prefetcht0), one tile ahead as before, a tile's 32 lines of keys and 32 of values
// filled the L1 miss buffers that the demand loads wait on: 30 layers x 32 requests x 256 tokens
// in bfloat16 on shuffled pages read at ~9 GB/s, 1.4-1.6x faster this way (2.0x at 1,024
// tokens; 3 or 4 tiles ahead were slower again) on a Zen 4. Asked for a tile at a time, those
// prefetches then stalled the kernel themselves (perf put a fifth of its samples on them): the
// two-pass kernels spread them a row at a time over the dot products, and fetch each tile's
// values with its keys: 1.24-1.31x (float queries) and 1.04-1.08x (bf16) more. (The plain C
// kernel still asks a tile at a time.)
#define PREFETCH_TILES 2

static inline void prefetch_rows(const void* rows, int64_t slot, int64_t row_bytes) {
    const char* p = (const char*)rows + slot * row_bytes;
    for (int64_t o = 0; o < TILE * row_bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

// As the tile [base, base + n) of the item [t0, t1) starts: the tiles after it, up to
// PREFETCH_TILES ahead, of one stream (keys or values). (The bound sits in the loop: with an
// early return inside prefetch_rows instead, gcc 12 at -O3 dropped every prefetch.)
static inline void prefetch_ahead(const void* rows, const int32_t* table, int64_t PS, int64_t t0, int64_t base,
                                  int64_t n, int64_t t1, int64_t row_bytes) {
    const int64_t last = base + n + (PREFETCH_TILES - 1) * TILE;
    for (int64_t pos = base == t0 ? base + n : last; pos < t1 && pos <= last; pos += TILE)
        prefetch_rows(rows, (int64_t)table[pos / PS] * PS + pos % PS, row_bytes);
}

// Row j of the rows at `rows`, into L2: the kernels' prefetch a row at a time. Always inlined: a
// call left out of line kept row_bytes a variable, and the kernels ran 3-14 % slower.
static inline __attribute__((always_inline)) void prefetch_row(const char* rows, int64_t j, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(rows + j * row_bytes + o, 0, 2);
}

// The row at position pos of a request's keys or values (table, pages of PS), or NULL past t1.
static inline const char* row_at(const void* rows, const int32_t* table, int64_t PS, int64_t pos, int64_t t1,
                                 int64_t row_bytes) {
    return pos < t1 ? (const char*)rows + ((int64_t)table[pos / PS] * PS + pos % PS) * row_bytes : NULL;
}

// Online softmax over one tile's scores s[g, 0..n): rescale what came before when the max rises.
static inline void softmax_tile(float* s, int64_t n, int64_t G, int64_t D, float* acc, float* m, float* l) {
    for (int64_t g = 0; g < G; g++) {
        float* sg = s + g * TILE;
#if defined(__AVX512F__)
        // Vector max, exp and sum: a scalar pass over the tile cost as much as its dot products.
        const __mmask16 live = (__mmask16)((1u << n) - 1u);
        const __m512 sv = _mm512_maskz_loadu_ps(live, sg);
        const float tile_mx = _mm512_mask_reduce_max_ps(live, sv);
        const float mx = tile_mx > m[g] ? tile_mx : m[g];
        const __m512 p = _mm512_maskz_mov_ps(live, vexp2(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
        _mm512_storeu_ps(sg, p);
        const float sum = _mm512_reduce_add_ps(p);
        if (mx > m[g]) {  // 0 on the first tile (m = -inf)
            const float alpha = exp2f(m[g] - mx);
            const __m512 av = _mm512_set1_ps(alpha);
            int64_t d = 0;
            for (; d + 16 <= D; d += 16)
                _mm512_storeu_ps(acc + g * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d), av));
            for (; d < D; d++) acc[g * D + d] *= alpha;  // the scalar kernel's odd head sizes
            l[g] *= alpha;
        }
        l[g] += sum;
        m[g] = mx;
#else
        float mx = m[g];
        for (int64_t j = 0; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;
        const float alpha = exp2f(m[g] - mx);  // 0 on the first tile (m = -inf)
        float sum = 0.f;
        for (int64_t j = 0; j < n; j++) { sg[j] = exp2f(sg[j] - mx); sum += sg[j]; }
        l[g] = l[g] * alpha + sum;
        m[g] = mx;
        if (alpha != 1.f)
            for (int64_t d = 0; d < D; d++) acc[g * D + d] *= alpha;
#endif
    }
}

// One work item in plain C: query heads [G, D] (float, scaled by scale * log2 e) over tokens
// [t0, t1) of one request and kv head, a tile of up to TILE keys at a time with an online
// softmax. Leaves the unnormalised output in acc [G, D] and the running max (base 2) and sum in
// m[G], l[G]. Tiles never cross a page, so a tile's key and value rows are consecutive. cap2: the
// scores' soft-cap in base 2 (0: none), as in every kernel here.
static void attend_chunk_scalar(const float* qf, const void* kh, const void* vh, const int32_t* table, int64_t PS,
                                int64_t t0, int64_t t1, int64_t G, int64_t D, int kv_bf16, float cap2,
                                float* acc, float* m, float* l, float* rowbuf) {
    const size_t esz = kv_bf16 ? 2 : 4;
    float s[MAX_GROUP * TILE];
    for (int64_t g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t base = t0; base < t1;) {
        const int64_t page = base / PS, off = base - page * PS;
        int64_t n = PS - off < TILE ? PS - off : TILE;
        n = n < t1 - base ? n : t1 - base;
        const int64_t slot0 = (int64_t)table[page] * PS + off;
        prefetch_ahead(kh, table, PS, t0, base, n, t1, D * esz);
        prefetch_ahead(vh, table, PS, t0, base, n, t1, D * esz);
        base += n;
        for (int64_t j = 0; j < n; j++) {
            load_row(rowbuf, (const char*)kh + (slot0 + j) * D * esz, D, kv_bf16);
            for (int64_t g = 0; g < G; g++) {
                float a = 0.f;
                for (int64_t d = 0; d < D; d++) a += qf[g * D + d] * rowbuf[d];
                s[g * TILE + j] = a;
            }
        }
        if (cap2 > 0.f)
            for (int64_t g = 0; g < G; g++) soft_cap(s + g * TILE, n, 1.f, cap2);
        softmax_tile(s, n, G, D, acc, m, l);
        for (int64_t j = 0; j < n; j++) {
            load_row(rowbuf, (const char*)vh + (slot0 + j) * D * esz, D, kv_bf16);
            for (int64_t g = 0; g < G; g++) {
                const float w = s[g * TILE + j];
                for (int64_t d = 0; d < D; d++) acc[g * D + d] += w * rowbuf[d];
            }
        }
    }
}

#if defined(__AVX512F__)
// A row of n scores (base 2; s 64-byte aligned) -> its softmax numerators 2^(s - max), in place,
// and also into pb as bfloat16 where pb is given (AVX512-BF16 builds); the max into *mx, the
// numerators' sum returned: the two-pass kernels' one softmax pass.
static inline __attribute__((always_inline)) float softmax_numerators(float* s, int64_t n, float* mx, uint16_t* pb) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) top = _mm512_max_ps(top, _mm512_load_ps(s + j));
    const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1u);
    *mx = _mm512_reduce_max_ps(_mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + j)));
    const __m512 mv = _mm512_set1_ps(*mx);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(live, vexp2(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
        _mm512_storeu_ps(s + j, p);
#if defined(__AVX512BF16__)
        if (pb) _mm256_mask_storeu_epi16(pb + j, live, vcvt_bf16_normal(p));
#endif
        sum = _mm512_add_ps(sum, p);
    }
    (void)pb;
    return _mm512_reduce_add_ps(sum);
}
#endif

#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
// A bfloat16 cache (a bfloat16 model's, or --kv-cache-dtype bfloat16) on a CPU with AVX512-BF16,
// two passes like attend_chunk_two_pass, both on VDPBF16PS: the queries rounded to bfloat16 once
// per item (a bfloat16 model's queries are bfloat16; the one-call decode step keeps them float
// until here), every score of the item as x . k on the raw keys (two instructions per key and
// head at head_dim 64, then transpose_sum16), scaled after; one softmax pass; the probabilities
// rounded to bfloat16 (as a bfloat16 model's attention rounds them before its value matmul) and
// summed over pairs of value rows, 16 dims and two keys per instruction. Against the float kernel
// over the same cache (which widened every key once per query head and every value once, then
// one FMA per key, head and 16 dims) and the online-softmax bf16 kernel before it: 1.18-1.24x
// with the KV in cache (32 requests x 256 tokens, 30 layers, on a Zen 5), level from memory,
// where the reads of a step's KV (~22 GB/s on shuffled pages) bound both.
// G heads and ND 16-float chunks of head_dim are compile-time (the dispatcher instantiates them),
// so the queries and, for 32 dims at a time, the accumulators stay in registers.
static inline __attribute__((always_inline)) void attend_chunk_two_pass_bf16(
        const int64_t G, const int64_t ND, const uint16_t* qb, const void* kh, const void* vh, const int32_t* table,
        int64_t PS, int64_t t0, int64_t t1, float qscale, float cap2, float* acc, float* m, float* l) {
    const int64_t D = ND * 16, n_all = t1 - t0, row_bytes = D * 2;
    float s[MAX_GROUP * SCORE_STRIDE] __attribute__((aligned(64)));
    // the probabilities in bfloat16, one spare zero at the end: a pair starting at the item's last key
    uint16_t p[MAX_GROUP][TWO_PASS_MAX + 2] __attribute__((aligned(64)));
    __m512bh q[G][ND / 2];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < ND / 2; c++) q[g][c] = (__m512bh)_mm512_loadu_si512(qb + g * D + c * 32);
    const __m512 sv = _mm512_set1_ps(qscale);
    for (int64_t base = t0; base < t1;) {  // scores, a page's run of up to 16 keys at a time
        const int64_t page = base / PS, off = base - page * PS;
        int64_t n = PS - off < TILE ? PS - off : TILE;
        n = n < t1 - base ? n : t1 - base;
        const char* krows = (const char*)kh + ((int64_t)table[page] * PS + off) * row_bytes;
        const int64_t j0 = base - t0;
        // L2 prefetches a row at a time between the dot products, as in attend_chunk_two_pass
        const char* kahead =
            base == t0 ? NULL : row_at(kh, table, PS, base + n + (PREFETCH_TILES - 1) * TILE, t1, row_bytes);
        const char* vnow = (const char*)vh + ((int64_t)table[page] * PS + off) * row_bytes;
        if (base == t0) prefetch_ahead(kh, table, PS, t0, base, n, t1, row_bytes);
        base += n;
        for (int64_t g = 0; g < G; g++) {
            __m512 dots[TILE];
            for (int64_t j = 0; j < TILE; j++) {
                if (kahead && g == 0)
                    prefetch_row(kahead, j, row_bytes);
                if (g == G - 1 && j < n)
                    prefetch_row(vnow, j, row_bytes);
                dots[j] = _mm512_setzero_ps();
                if (j >= n) continue;
                for (int64_t c = 0; c < ND / 2; c++)
                    dots[j] = _mm512_dpbf16_ps(dots[j], q[g][c], (__m512bh)_mm512_loadu_si512(krows + j * row_bytes + c * 64));
            }
            _mm512_storeu_ps(s + g * SCORE_STRIDE + j0, _mm512_mul_ps(transpose_sum16(dots), sv));
        }
    }
    for (int64_t g = 0; g < G; g++) {  // softmax numerators in base 2, their max and sum; in bfloat16
        if (cap2 > 0.f) soft_cap(s + g * SCORE_STRIDE, n_all, 1.f, cap2);
        l[g] = softmax_numerators(s + g * SCORE_STRIDE, n_all, &m[g], p[g]);
        p[g][n_all] = p[g][n_all + 1] = 0;
    }
    for (int64_t c = 0; c < ND / 2; c++) {  // values, 32 dims at a time, page by page
        __m512 lo[G], hi[G];
        for (int64_t g = 0; g < G; g++) lo[g] = hi[g] = _mm512_setzero_ps();
        for (int64_t base = t0; base < t1;) {
            const int64_t page = base / PS, off = base - page * PS;
            const int64_t n = PS - off < t1 - base ? PS - off : t1 - base;
            const char* vrows = (const char*)vh + ((int64_t)table[page] * PS + off) * row_bytes + c * 64;
            const int64_t j0 = base - t0;
            base += n;  // (its rows were prefetched with the keys)
            for (int64_t j = 0; j < n; j += 2) {
                const __m512i a = _mm512_loadu_si512(vrows + j * row_bytes);
                // past the run: zeros (the next key's probability may pair with it; 0 x stale memory could be NaN)
                const __m512i b = j + 1 < n ? _mm512_loadu_si512(vrows + (j + 1) * row_bytes) : _mm512_setzero_si512();
                const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                for (int64_t g = 0; g < G; g++) {
                    int32_t pair;  // probabilities of keys j and j + 1
                    memcpy(&pair, p[g] + j0 + j, sizeof pair);
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
                    lo[g] = _mm512_dpbf16_ps(lo[g], w, vlo);
                    hi[g] = _mm512_dpbf16_ps(hi[g], w, vhi);
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 first, second;
            unpack_order32(lo[g], hi[g], &first, &second);
            _mm512_storeu_ps(acc + g * D + c * 32, first);
            _mm512_storeu_ps(acc + g * D + c * 32 + 16, second);
        }
    }
}
#endif

// Float queries (already scaled) over at most TWO_PASS_MAX keys: every score of the chunk first,
// then one softmax pass, then the values. Against an online softmax this drops the per-tile max,
// sum and rescale of the accumulators (three dependent reductions per head every 16 keys, which
// cost as much as the dot products), and reads float32 keys in place.
static inline __attribute__((always_inline)) void attend_chunk_two_pass(
        const int64_t G, const int64_t ND, const float* qf, const void* kh, const void* vh, const int32_t* table,
        int64_t PS, int64_t t0, int64_t t1, int kv_bf16, float cap2, float* acc, float* m, float* l) {
    const int64_t D = ND * 16, n_all = t1 - t0;
    const size_t esz = kv_bf16 ? 2 : 4;
    // a head's scores SCORE_STRIDE apart
    float s[MAX_GROUP * SCORE_STRIDE] __attribute__((aligned(64)));
    __m512 q[G][ND];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < ND; c++) q[g][c] = _mm512_loadu_ps(qf + g * D + c * 16);
    for (int64_t base = t0; base < t1;) {  // scores, a page's run of up to 16 keys at a time
        const int64_t page = base / PS, off = base - page * PS;
        int64_t n = PS - off < TILE ? PS - off : TILE;
        n = n < t1 - base ? n : t1 - base;
        const char* krows = (const char*)kh + ((int64_t)table[page] * PS + off) * D * esz;
        const int64_t j0 = base - t0;
        // Prefetches into L2, a row at a time between the dot products (a tile's worth at once
        // stalled on the full miss queue with nothing else to do): the keys PREFETCH_TILES ahead,
        // after the first tile's burst, and this tile's values, for the values' pass.
        const char* kahead =
            base == t0 ? NULL : row_at(kh, table, PS, base + n + (PREFETCH_TILES - 1) * TILE, t1, D * esz);
        const char* vnow = (const char*)vh + ((int64_t)table[page] * PS + off) * D * esz;
        if (base == t0) prefetch_ahead(kh, table, PS, t0, base, n, t1, D * esz);
        base += n;
        for (int64_t g = 0; g < G; g++) {
            __m512 dots[TILE];
            for (int64_t j = 0; j < TILE; j++) {
                if (kahead && g == 0)
                    prefetch_row(kahead, j, D * esz);
                if (g == G - 1 && j < n)
                    prefetch_row(vnow, j, D * esz);
                dots[j] = _mm512_setzero_ps();
                if (j >= n) continue;
                for (int64_t c = 0; c < ND; c++)
                    dots[j] = _mm512_fmadd_ps(q[g][c], vload(krows + j * D * esz, c * 16, kv_bf16), dots[j]);
            }
            _mm512_storeu_ps(s + g * SCORE_STRIDE + j0, transpose_sum16(dots));  // lanes past n: 0, overwritten
        }
    }
    for (int64_t g = 0; g < G; g++) {  // softmax numerators in base 2, their max and sum
        if (cap2 > 0.f) soft_cap(s + g * SCORE_STRIDE, n_all, 1.f, cap2);
        l[g] = softmax_numerators(s + g * SCORE_STRIDE, n_all, &m[g], NULL);
    }
    __m512 a[G][ND];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < ND; c++) a[g][c] = _mm512_setzero_ps();
    for (int64_t base = t0; base < t1;) {  // values, page by page
        const int64_t page = base / PS, off = base - page * PS;
        int64_t n = PS - off < t1 - base ? PS - off : t1 - base;
        const char* vrows = (const char*)vh + ((int64_t)table[page] * PS + off) * D * esz;
        const int64_t j0 = base - t0;
        base += n;  // (its rows were prefetched with the keys)
        for (int64_t j = 0; j < n; j++)
            for (int64_t c = 0; c < ND; c++) {
                const __m512 vv = vload(vrows + j * D * esz, c * 16, kv_bf16);
                for (int64_t g = 0; g < G; g++)
                    a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * SCORE_STRIDE + j0 + j]), vv, a[g][c]);
            }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < ND; c++) _mm512_storeu_ps(acc + g * D + c * 16, a[g][c]);
}

#if defined(__AVX512BF16__)
#define CASE_BF16(GV, NDV)                                                                                 \
    if (qb != NULL && t1 - t0 <= TWO_PASS_MAX) {                                                           \
        attend_chunk_two_pass_bf16(GV, NDV, qb, kh, vh, table, PS, t0, t1, qscale, cap2, acc, m, l);       \
        return 1;                                                                                          \
    }
#else
#define CASE_BF16(GV, NDV)  // a bfloat16 cache takes the float kernel: qf holds the queries too
#endif
#define CASE_G(GV, NDV) case GV:                                                                         \
    CASE_BF16(GV, NDV)                                                                                     \
    if (t1 - t0 > TWO_PASS_MAX) return 0;                                                                  \
    if (kv_bf16) attend_chunk_two_pass(GV, NDV, qf, kh, vh, table, PS, t0, t1, 1, cap2, acc, m, l);        \
    else attend_chunk_two_pass(GV, NDV, qf, kh, vh, table, PS, t0, t1, 0, cap2, acc, m, l);                \
    return 1;
#define CASES_G(NDV) switch (G) { CASE_G(1, NDV) CASE_G(2, NDV) CASE_G(3, NDV) CASE_G(4, NDV) \
                                  CASE_G(5, NDV) CASE_G(6, NDV) CASE_G(7, NDV) CASE_G(8, NDV) default: break; }

// Runs the kernel specialised for (G, D) where it was built for them, else its runtime-shaped
// instance (any head_dim of whole 16-float vectors, any group; float, a bfloat16 cache widened);
// returns 0 for the rest (the plain C kernel's).
static int attend_chunk_fast(const float* qf, const uint16_t* qb, const void* kh, const void* vh, const int32_t* table,
                             int64_t PS, int64_t t0, int64_t t1, int64_t G, int64_t D, int kv_bf16, float qscale,
                             float cap2, float* acc, float* m, float* l) {
    switch (D) {
        case 64: CASES_G(4)
        case 128: CASES_G(8)
        default: break;
    }
    if (t1 - t0 > TWO_PASS_MAX || D % 16 || G > MAX_GROUP) return 0;
    attend_chunk_two_pass(G, D / 16, qf, kh, vh, table, PS, t0, t1, kv_bf16, cap2, acc, m, l);
    return 1;
}
#else
// Every other level: the same two passes over vec.h's VL lanes (AVX2 + FMA, or generic C), for
// float32 keys or bfloat16 ones widened as they load. These levels ran the plain C kernel before,
// whose dot products are scalar chains (C does not let the compiler reorder their float sums into
// vectors): at AVX2, 32 requests x 600 tokens with the KV in cache, 3.7x faster on one core.

// softmax_numerators (above) without masks: the max over whole vectors and a scalar tail, the
// numerators 2^(s - max) in place, their sum returned.
static inline __attribute__((always_inline)) float softmax_numerators(float* s, int64_t n, float* mx) {
    vf top = vf_set1(-INFINITY);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) top = vf_max(top, vf_load(s + j));
    float m = vf_hmax(top);
    for (int64_t i = j; i < n; i++) m = s[i] > m ? s[i] : m;
    *mx = m;
    const vf mv = vf_set1(m);
    vf sum = vf_zero();
    for (j = 0; j + VL <= n; j += VL) {
        const vf p = vf_exp2(vf_sub(vf_load(s + j), mv));
        vf_store(s + j, p);
        sum = vf_add(sum, p);
    }
    float total = vf_sum(sum);
    if (j < n) {  // the last n - j, stored alone: the lanes past n are no key's
        vf_store_n(s + j, vf_exp2(vf_sub(vf_load_n(s + j, n - j), mv)), n - j);
        for (int64_t i = j; i < n; i++) total += s[i];
    }
    return total;
}

// acc [G, D] = p . V over the item's keys [t0, t1) (p: s [G][SCORE_STRIDE], the probabilities),
// for the NV vectors of output dimensions from vector c0 on.
static inline __attribute__((always_inline)) void values_two_pass(const int64_t G, const int64_t NV, int64_t c0,
                                                                  const float* s, const void* vh,
                                                                  const int32_t* table, int64_t PS, int64_t t0,
                                                                  int64_t t1, int64_t D, int kv_bf16, float* acc) {
    const size_t esz = kv_bf16 ? 2 : 4;
    vf a[MAX_GROUP][8];  // [G][NV] (NV <= 8), fixed: a runtime G made it a VLA that gcc could not bound
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < NV; c++) a[g][c] = vf_zero();
    for (int64_t base = t0; base < t1;) {  // page by page
        const int64_t page = base / PS, off = base - page * PS;
        int64_t n = PS - off < t1 - base ? PS - off : t1 - base;
        const char* vrows = (const char*)vh + ((int64_t)table[page] * PS + off) * D * esz + c0 * VL * esz;
        const float* p = s + (base - t0);
        base += n;  // (its rows were prefetched with the keys)
        for (int64_t j = 0; j < n; j++) {
            if (kv_bf16 && NV % 2 == 0) {  // pairs widened in vf_from_bf16_2's order, put back at the end
                for (int64_t c = 0; c < NV; c += 2) {
                    vf va, vb;
                    vf_from_bf16_2((const uint16_t*)(vrows + j * D * esz) + c * VL, &va, &vb);
                    for (int64_t g = 0; g < G; g++) {
                        const vf w = vf_set1(p[g * SCORE_STRIDE + j]);
                        a[g][c] = vf_fma(w, va, a[g][c]);
                        a[g][c + 1] = vf_fma(w, vb, a[g][c + 1]);
                    }
                }
                continue;
            }
            for (int64_t c = 0; c < NV; c++) {
                const vf vv = vf_load_act(vrows + j * D * esz, c * VL, kv_bf16);
                for (int64_t g = 0; g < G; g++) a[g][c] = vf_fma(vf_set1(p[g * SCORE_STRIDE + j]), vv, a[g][c]);
            }
        }
    }
    if (kv_bf16 && NV % 2 == 0)
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < NV; c += 2) vf_order2(&a[g][c], &a[g][c + 1]);
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < NV; c++) vf_store(acc + g * D + (c0 + c) * VL, a[g][c]);
}

// One query head's scores (q, scaled) for the VL keys at rows (row_bytes apart), the first `live`
// of them real: lanes past those repeat the last (the next run's scores overwrite them, or they lie
// past the item). Dims outside, keys inside: VL independent FMA chains (keys outside made each dot
// product a chain of ND dependent FMAs). Spread over the dims, the L2 prefetches of rows ahead[0,
// VL) and vnow[0, nv) (either NULL: none), as attend_chunk_two_pass spreads them over its keys.
static inline __attribute__((always_inline)) vf key_scores(const int64_t ND, const int64_t live, const float* q,
                                                           const char* rows, int64_t row_bytes, int kv_bf16,
                                                           const char* ahead, const char* vnow, int64_t nv) {
    vf dots[VL];
    for (int64_t j = 0; j < VL; j++) dots[j] = vf_zero();
    for (int64_t c = 0; c < ND; c++) {
        for (int64_t j = c; j < VL; j += ND) {
            if (ahead) prefetch_row(ahead, j, row_bytes);
            if (vnow && j < nv) prefetch_row(vnow, j, row_bytes);
        }
        const vf qv = vf_load(q + c * VL);
        for (int64_t j = 0; j < VL; j++)
            dots[j] = vf_fma(qv, vf_load_act(rows + (j < live ? j : live - 1) * row_bytes, c * VL, kv_bf16), dots[j]);
    }
    return vf_sums(dots);
}

// A bfloat16 cache's keys widen once per block of VL keys into a float buffer that every query
// head of the group then reads (L1), rather than once per head: with G heads per kv head each key
// cost G widenings (a shift and a zero-extend per vector, on the FMA ports) before. Head_dim up to
// MAX_D_WIDE; a group of one widens as it loads (nothing to share).
#define MAX_D_WIDE 256
#define WIDEN_ONCE(G, kv_bf16) ((kv_bf16) && (G) > 1 && ND * VL <= MAX_D_WIDE)

// rows (row_bytes apart, bfloat16, the first `live` real) -> kbuf [VL][ND * VL] floats; rows past
// live repeat the last (their lanes' scores are overwritten or lie past the item).
// Pairs of vectors widen in vf_from_bf16_2's order (no shift), an odd last one in order: the
// queries go into the same order (in_pair_order).
static inline __attribute__((always_inline)) void widen_block(const int64_t ND, const char* rows, int64_t row_bytes,
                                                              int64_t live, float* kbuf) {
    for (int64_t j = 0; j < VL; j++) {
        const uint16_t* row = (const uint16_t*)(rows + (j < live ? j : live - 1) * row_bytes);
        float* dst = kbuf + j * ND * VL;
        int64_t c = 0;
        for (; c + 2 <= ND; c += 2) {
            vf a, b;
            vf_from_bf16_2(row + c * VL, &a, &b);
            vf_store(dst + c * VL, a);
            vf_store(dst + (c + 1) * VL, b);
        }
        if (c < ND) vf_store(dst + c * VL, vf_from_bf16(row + c * VL));
    }
}

// G rows of ND vectors, each pair of vectors into vf_from_bf16_2's order (or back: the same
// shuffle), an odd last one left alone.
static inline __attribute__((always_inline)) void in_pair_order(const int64_t G, const int64_t ND, const float* src,
                                                                float* dst) {
    for (int64_t g = 0; g < G; g++) {
        int64_t c = 0;
        for (; c + 2 <= ND; c += 2) {
            vf a = vf_load(src + (g * ND + c) * VL), b = vf_load(src + (g * ND + c + 1) * VL);
            vf_order2(&a, &b);
            vf_store(dst + (g * ND + c) * VL, a);
            vf_store(dst + (g * ND + c + 1) * VL, b);
        }
        if (c < ND) vf_store(dst + (g * ND + c) * VL, vf_load(src + (g * ND + c) * VL));
    }
}

// attend_chunk_two_pass (above) over VL lanes: a page's run of up to TILE keys at a time, VL keys'
// dot products summed across lanes together (vf_sums); the same prefetches, a row at a time.
// G and ND (head_dim / VL) are compile-time in the dispatcher's instances, runtime in its last.
static inline __attribute__((always_inline)) void attend_chunk_two_pass(
        const int64_t G, const int64_t ND, const float* qf, const void* kh, const void* vh, const int32_t* table,
        int64_t PS, int64_t t0, int64_t t1, int kv_bf16, float cap2, float* acc, float* m, float* l) {
    const int64_t D = ND * VL, n_all = t1 - t0;
    const size_t esz = kv_bf16 ? 2 : 4;
    // a head's scores SCORE_STRIDE apart
    float s[MAX_GROUP * SCORE_STRIDE] __attribute__((aligned(64)));
    float kbuf[VL * MAX_D_WIDE] __attribute__((aligned(64)));  // a block of keys widened (WIDEN_ONCE)
    float qo[MAX_GROUP * MAX_D_WIDE] __attribute__((aligned(64)));  // the queries in kbuf's order
    if (WIDEN_ONCE(G, kv_bf16)) in_pair_order(G, ND, qf, qo);
    for (int64_t base = t0; base < t1;) {  // scores
        const int64_t page = base / PS, off = base - page * PS;
        int64_t n = PS - off < TILE ? PS - off : TILE;
        n = n < t1 - base ? n : t1 - base;
        const char* krows = (const char*)kh + ((int64_t)table[page] * PS + off) * D * esz;
        const int64_t j0 = base - t0;
        const char* kahead =
            base == t0 ? NULL : row_at(kh, table, PS, base + n + (PREFETCH_TILES - 1) * TILE, t1, D * esz);
        const char* vnow = (const char*)vh + ((int64_t)table[page] * PS + off) * D * esz;
        if (base == t0) prefetch_ahead(kh, table, PS, t0, base, n, t1, D * esz);
        base += n;
        for (int64_t h = 0; h < TILE; h += VL) {  // VL keys at a time, every head against them
            const char* ahead = kahead ? kahead + h * D * esz : NULL;
            if (h >= n) {  // past the run: only the prefetches ahead
                for (int64_t j = 0; ahead && j < VL; j++) prefetch_row(ahead, j, D * esz);
                continue;
            }
            const int64_t live = n - h < VL ? n - h : VL;
            const char* rows = krows + h * D * esz;
            if (WIDEN_ONCE(G, kv_bf16)) {  // the block's keys widened once, for all G heads
                widen_block(ND, rows, D * esz, live, kbuf);
                for (int64_t g = 0; g < G; g++)
                    vf_store(s + g * SCORE_STRIDE + j0 + h,
                             key_scores(ND, VL, qo + g * D, (const char*)kbuf, D * 4, 0, g == 0 ? ahead : NULL,
                                        g == G - 1 ? vnow + h * D * esz : NULL, live));
                continue;
            }
            for (int64_t g = 0; g < G; g++) {
                const char* vn = g == G - 1 ? vnow + h * D * esz : NULL;
                const char* ah = g == 0 ? ahead : NULL;
                const vf sc = live == VL ? key_scores(ND, VL, qf + g * D, rows, D * esz, kv_bf16, ah, vn, VL)
                                         : key_scores(ND, live, qf + g * D, rows, D * esz, kv_bf16, ah, vn, live);
                vf_store(s + g * SCORE_STRIDE + j0 + h, sc);  // lanes past n: overwritten, or past the item
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {  // softmax numerators in base 2, their max and sum
        if (cap2 > 0.f) soft_cap(s + g * SCORE_STRIDE, n_all, 1.f, cap2);
        l[g] = softmax_numerators(s + g * SCORE_STRIDE, n_all, &m[g]);
    }
    // values: CB vectors of every head's output at a time, at most 12 accumulators (AVX2 has 16
    // registers; all G x ND of them at once spilled), a power of two that divides ND
    const int64_t CB = ND % 8 ? 1 : G == 1 ? 8 : G <= 3 ? 4 : G <= 6 ? 2 : 1;
    for (int64_t c0 = 0; c0 < ND; c0 += CB) values_two_pass(G, CB, c0, s, vh, table, PS, t0, t1, D, kv_bf16, acc);
}

#define CASE_P(GV, NDV) case GV:                                                                         \
    if (kv_bf16) attend_chunk_two_pass(GV, NDV, qf, kh, vh, table, PS, t0, t1, 1, cap2, acc, m, l);        \
    else attend_chunk_two_pass(GV, NDV, qf, kh, vh, table, PS, t0, t1, 0, cap2, acc, m, l);                \
    return 1;
#define CASES_P(NDV) switch (G) { CASE_P(1, NDV) CASE_P(2, NDV) CASE_P(3, NDV) CASE_P(4, NDV) \
                                  CASE_P(5, NDV) CASE_P(6, NDV) CASE_P(7, NDV) CASE_P(8, NDV) default: break; }

// The kernel specialised for (G, D) where it was built for them, else its runtime-shaped instance
// (any head_dim of whole vectors, any group); returns 0 for the rest (the plain C kernel's).
static int attend_chunk_fast(const float* qf, const uint16_t* qb, const void* kh, const void* vh, const int32_t* table,
                             int64_t PS, int64_t t0, int64_t t1, int64_t G, int64_t D, int kv_bf16, float qscale,
                             float cap2, float* acc, float* m, float* l) {
    (void)qb; (void)qscale;  // (the queries come scaled in qf)
    if (t1 - t0 > TWO_PASS_MAX || D % VL || G > MAX_GROUP) return 0;
    switch (D) {
        case 64: CASES_P(64 / VL) break;
        case 128: CASES_P(128 / VL) break;
        default: break;
    }
    attend_chunk_two_pass(G, D / VL, qf, kh, vh, table, PS, t0, t1, kv_bf16, cap2, acc, m, l);
    return 1;
}
#endif

static void attend_chunk(const float* qf, const uint16_t* qb, const void* kh, const void* vh, const int32_t* table,
                         int64_t PS, int64_t t0, int64_t t1, int64_t G, int64_t D, int kv_bf16, float qscale,
                         float cap2, float* acc, float* m, float* l, float* rowbuf) {
    if (attend_chunk_fast(qf, qb, kh, vh, table, PS, t0, t1, G, D, kv_bf16, qscale, cap2, acc, m, l)) return;
    attend_chunk_scalar(qf, kh, vh, table, PS, t0, t1, G, D, kv_bf16, cap2, acc, m, l, rowbuf);
}

// q/out: io_bf16 says float32 or bfloat16; k/v: kv_bf16 likewise. chunk: tokens per work item.
// q rows are q_stride elements apart (q may be a view into a fused qkv row). new_k/new_v, when
// not NULL, hold each request's new token's keys and values ([B, HKV, D], rows k_stride and
// v_stride apart, in q's dtype): they are written into the cache at the request's last position
// first.
int relay_attend_shared(const uint16_t* const* qrows, const int64_t* first, int64_t rows, const uint16_t* kh,
                        const uint16_t* vh, const int32_t* table, int64_t PS, int64_t k0, int64_t k1, int64_t D,
                        float qscale, float cap2, float* const* acc_out, float* const* m_out,
                        float* const* l_out);  // extend_attention.c
int relay_attend_shared_f32(const void* const* qrows, int io_bf16, const int64_t* first, int64_t rows, const void* kh,
                            const void* vh, int kv_bf16, const int32_t* table, int64_t PS, int64_t k0, int64_t k1,
                            int64_t D, float qscale, float cap2, float* const* acc_out, float* const* m_out,
                            float* const* l_out);

typedef struct {
    int64_t group;  // >= 0: a shared-prefix item of this group; -1: a request's own keys
    int64_t h, rank, c;  // kv head; the request (its rank in order) or the group's; the chunk
} DecodeItem;

// Groups (optional, n_groups > 0, where relay_tiled_attention_available says so): requests order[first[g]],
// ..., order[first[g] + size[g] - 1] share the pages of their first keys[g] tokens (a cached
// system prompt). Those keys are attended once for all of the group's queries (cascade
// attention: one pass over the shared KV instead of one per request), and each request's own
// keys after them as usual; the parts merge by their log-sum-exp like any other chunks.
// window (0: none): a request of length L attends its keys L - window .. L - 1 only (its query sits
// at L - 1: p - window < j <= p), so its work items start there: chunks and pages wholly before the
// window are never read, a group's shared chunks included where no request of the group sees them
// (the rest take each request's own first key, per query row). softcap (0: none): scores ->
// softcap * tanh(score / softcap) after the scale, before the softmax (Gemma 2). sinks (NULL: none):
// a learned logit per query head [H] that joins each row's softmax denominator and attends no value
// (gpt-oss): added where the chunks merge, the one place a row's whole sum is known.
void decode_attention(const void* q, int64_t q_stride, const void* new_k, int64_t k_stride, const void* new_v,
                      int64_t v_stride,
                      void* k, void* v, const int32_t* tables, const int64_t* lens,
                      const int64_t* order, void* out, int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t S,
                      int64_t P, int64_t PS, int64_t chunk, float scale, int io_bf16, int kv_bf16,
                      int64_t window, float softcap, int64_t n_groups, const int64_t* group_first,
                      const int64_t* group_size, const int64_t* group_keys, const float* sinks) {
    const int64_t G = H / HKV;
    const float qscale = scale * 1.4426950408889634f;  // softmax in base 2
    const float cap2 = softcap > 0.f ? softcap * 1.4426950408889634f : 0.f;  // the cap in base 2 too
    const size_t esz = kv_bf16 ? 2 : 4;
    // By rank: the keys of its group's shared prefix (0: none), the first key its window shows it,
    // and the first of its own keys that it attends (after both).
    int64_t* shared = (int64_t*)calloc((size_t)(3 * B + 1), sizeof(int64_t));
    int64_t* first = shared + B;
    int64_t* begin = first + B;
    for (int64_t g = 0; g < n_groups; g++)
        for (int64_t r = group_first[g]; r < group_first[g] + group_size[g]; r++) shared[r] = group_keys[g];
    for (int64_t r = 0; r < B; r++) {
        const int64_t len = lens[order[r]];
        first[r] = window > 0 && len > window ? len - window : 0;
        begin[r] = first[r] > shared[r] ? first[r] : shared[r];
    }
    // By group: the first shared key any of its requests' windows shows (group_keys: none), and
    // the first chunk of its shared keys that holds one (the number of its chunks: none).
    int64_t* group_from = (int64_t*)malloc(sizeof(int64_t) * (size_t)(2 * n_groups + 1));
    int64_t* group_c0 = group_from + n_groups;
    for (int64_t g = 0; g < n_groups; g++) {
        group_from[g] = group_keys[g];
        for (int64_t r = group_first[g]; r < group_first[g] + group_size[g]; r++)
            group_from[g] = first[r] < group_from[g] ? first[r] : group_from[g];
        group_c0[g] = group_from[g] < group_keys[g] ? group_from[g] / chunk : (group_keys[g] + chunk - 1) / chunk;
    }
    // Partial slots per (kv head, rank): the shared prefix's chunks first, then the request's own.
    int64_t C = 1, count = 0;
    for (int64_t r = 0; r < B; r++) {
        const int64_t pre = (shared[r] + chunk - 1) / chunk, own = (lens[order[r]] - begin[r] + chunk - 1) / chunk;
        C = pre + own > C ? pre + own : C;
        count += HKV * own;
    }
    for (int64_t g = 0; g < n_groups; g++)
        count += HKV * ((group_keys[g] + chunk - 1) / chunk - group_c0[g]);
    DecodeItem* items = (DecodeItem*)malloc(sizeof(DecodeItem) * (size_t)(count ? count : 1));
    int64_t n = 0;
    for (int64_t g = 0; g < n_groups; g++)  // the heavy ones first
        for (int64_t h = 0; h < HKV; h++)
            for (int64_t c = group_c0[g]; c * chunk < group_keys[g]; c++)
                items[n++] = (DecodeItem){g, h, group_first[g], c};
    for (int64_t h = 0; h < HKV; h++)
        for (int64_t r = 0; r < B; r++)
            for (int64_t c = 0; begin[r] + c * chunk < lens[order[r]]; c++) items[n++] = (DecodeItem){-1, h, r, c};
    const int64_t slot_floats = G * (D + 2);  // acc [G, D], m [G], l [G]
    float* partial = (float*)malloc(sizeof(float) * (size_t)(HKV * B * C * slot_floats));
    _Pragma("omp parallel")
    {
        float* qf = (float*)malloc(sizeof(float) * G * D);
        uint16_t* qround = (uint16_t*)malloc(sizeof(uint16_t) * G * D);
        float* rowbuf = (float*)malloc(sizeof(float) * D);
        _Pragma("omp for schedule(static)")
        for (int64_t sl = 0; sl < HKV * B * C; sl++) {  // every slot starts empty
            float* m = partial + sl * slot_floats + G * D;
            for (int64_t g = 0; g < G; g++) { m[g] = -INFINITY; m[G + g] = 0.f; }
        }
        if (new_k != NULL) {
            _Pragma("omp for schedule(static)")
            for (int64_t pair = 0; pair < B * HKV; pair++) {
                const int64_t b = pair / HKV, h = pair % HKV, t = lens[b] - 1;
                const int64_t slot = (int64_t)tables[b * P + t / PS] * PS + t % PS;
                const int64_t ks = b * k_stride + h * D, vs = b * v_stride + h * D;
                for (int64_t d = 0; d < D; d++) {
                    const float kd = io_bf16 ? bf16_to_f32(((const uint16_t*)new_k)[ks + d]) : ((const float*)new_k)[ks + d];
                    const float vd = io_bf16 ? bf16_to_f32(((const uint16_t*)new_v)[vs + d]) : ((const float*)new_v)[vs + d];
                    const int64_t dst = (h * S + slot) * D + d;
                    if (kv_bf16) { ((uint16_t*)k)[dst] = f32_to_bf16(kd); ((uint16_t*)v)[dst] = f32_to_bf16(vd); }
                    else { ((float*)k)[dst] = kd; ((float*)v)[dst] = vd; }
                }
            }
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t i = 0; i < n; i++) {
            const DecodeItem it = items[i];
            const int64_t h = it.h;
            const char* kh = (const char*)k + h * S * D * esz;
            const char* vh = (const char*)v + h * S * D * esz;
            if (it.group >= 0) {  // one chunk of a group's shared keys, for all its queries
                const int64_t size = group_size[it.group], rows = size * G;
                const void** qrows = (const void**)malloc(sizeof(void*) * (size_t)rows);
                float** outs = (float**)malloc(sizeof(void*) * (size_t)rows * 3);
                int64_t* row_first = (int64_t*)malloc(sizeof(int64_t) * (size_t)rows);  // windows: per query row
                const size_t qsz = io_bf16 ? 2 : 4;
                for (int64_t rr = 0; rr < rows; rr++) {
                    const int64_t rank = it.rank + rr / G, g = rr % G, b = order[rank];
                    float* slot = partial + ((h * B + rank) * C + it.c) * slot_floats;
                    qrows[rr] = (const char*)q + (b * q_stride + (h * G + g) * D) * qsz;
                    row_first[rr] = first[rank];
                    outs[rr] = slot + g * D;
                    outs[rows + rr] = slot + G * D + g;
                    outs[2 * rows + rr] = slot + G * D + G + g;
                }
                const int64_t k1 = (it.c + 1) * chunk < group_keys[it.group] ? (it.c + 1) * chunk : group_keys[it.group];
                const int64_t k0 = it.c * chunk > group_from[it.group] ? it.c * chunk : group_from[it.group];
                const int32_t* table = tables + order[it.rank] * P;
#if defined(__AVX512BF16__)
                if (kv_bf16 && D % 32 == 0) {
                    // Float queries (the one-call decode step's) rounded to bfloat16 here: the shared
                    // keys are a small GEMM, and VDPBF16PS runs it ~2x the float kernel's speed over
                    // keys that are bfloat16 already.
                    uint16_t* rounded = io_bf16 ? NULL : (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(rows * D));
                    if (rounded)
                        for (int64_t rr = 0; rr < rows; rr++) {
                            for (int64_t d = 0; d < D; d += 16)
                                _mm256_storeu_si256((__m256i*)(rounded + rr * D + d),
                                                    vcvt_bf16(_mm512_loadu_ps((const float*)qrows[rr] + d)));
                            qrows[rr] = rounded + rr * D;
                        }
                    relay_attend_shared((const uint16_t* const*)qrows, row_first, rows, (const uint16_t*)kh,
                                        (const uint16_t*)vh, table, PS, k0, k1, D, qscale, cap2, outs, outs + rows,
                                        outs + 2 * rows);
                    free(rounded);
                } else
#endif
                    relay_attend_shared_f32(qrows, io_bf16, row_first, rows, kh, vh, kv_bf16, table, PS, k0, k1, D,
                                            qscale, cap2, outs, outs + rows, outs + 2 * rows);
                free(row_first);
                free(outs);
                free(qrows);
                continue;
            }
            const int64_t b = order[it.rank], pre = (shared[it.rank] + chunk - 1) / chunk;
            const int64_t t0 = begin[it.rank] + it.c * chunk;
            const int64_t t1 = t0 + chunk < lens[b] ? t0 + chunk : lens[b];
            float* acc = partial + ((h * B + it.rank) * C + pre + it.c) * slot_floats;
            for (int64_t g = 0; g < G; g++) {
                const int64_t row = b * q_stride + (h * G + g) * D;
                if (io_bf16) load_row(qf + g * D, (const uint16_t*)q + row, D, 1);
                else memcpy(qf + g * D, (const float*)q + row, sizeof(float) * D);
                for (int64_t d = 0; d < D; d++) qf[g * D + d] *= qscale;
            }
            // A bfloat16 cache: the queries in bfloat16 for attend_chunk_two_pass_bf16 (float ones rounded).
            const uint16_t* qb = NULL;
#if defined(__AVX512BF16__)
            if (kv_bf16 && io_bf16) qb = (const uint16_t*)q + b * q_stride + h * G * D;
            else if (kv_bf16) {
                for (int64_t gd = 0; gd < G * D; gd++) qround[gd] = f32_to_bf16(((const float*)q)[b * q_stride + h * G * D + gd]);
                qb = qround;
            }
#endif
            attend_chunk(qf, qb, kh, vh, tables + b * P, PS, t0, t1, G, D, kv_bf16, qscale, cap2, acc, acc + G * D,
                         acc + G * D + G, rowbuf);
        }
        // Merge each (request, kv head)'s chunks by their log-sum-exp and write the output.
        _Pragma("omp for schedule(static)")
        for (int64_t pair = 0; pair < HKV * B; pair++) {
            const int64_t h = pair / B, rank = pair % B, b = order[rank];
            const float* first = partial + (pair * C) * slot_floats;
            for (int64_t g = 0; g < G; g++) {
                // the sink in base 2, as the scores (the largest term may be the sink's)
                const float sink = sinks ? sinks[h * G + g] * 1.4426950408889634f : -INFINITY;
                float mx = sink;
                for (int64_t c = 0; c < C; c++) {
                    const float mc = first[c * slot_floats + G * D + g];
                    mx = mc > mx ? mc : mx;
                }
                float* o = rowbuf;
                memset(o, 0, sizeof(float) * D);
                float total = 0.f;
                for (int64_t c = 0; c < C; c++) {
                    const float* acc = first + c * slot_floats;
                    const float mc = acc[G * D + g], lc = acc[G * D + G + g];
                    if (lc == 0.f) continue;
                    const float w = exp2f(mc - mx);
                    total += w * lc;
                    for (int64_t d = 0; d < D; d++) o[d] += w * acc[g * D + d];
                }
                if (sinks) total += exp2f(sink - mx);
                const float inv = total > 0.f ? 1.f / total : 0.f;
                const int64_t row = (b * H + h * G + g) * D;
                if (io_bf16)
                    for (int64_t d = 0; d < D; d++) ((uint16_t*)out)[row + d] = f32_to_bf16(o[d] * inv);
                else
                    for (int64_t d = 0; d < D; d++) ((float*)out)[row + d] = o[d] * inv;
            }
        }
        free(rowbuf);
        free(qround);
        free(qf);
    }
    free(partial);
    free(items);
    free(group_from);
    free(shared);
}
