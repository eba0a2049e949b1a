// Paged attention of prompt chunks for CPUs: each request's new tokens over its
// cached prefix and themselves (causal), reading the KV cache in place.
//
// A work item is (request, kv head, block of 16 to 64 new tokens, item_block): its query rows
// (tokens x G) share every tile of 64 keys they read, so each tile is a small GEMM. bfloat16 queries and cache on a
// CPU with AVX512-BF16 (attend_rows): a tile is laid out once per item for VDPBF16PS, keys as
// [head_dim / 2][64] pairs of dimensions (one instruction: 16 keys' scores for two dimensions of
// a query row, no horizontal sums), values as [32 key pairs][head_dim] pairs of keys (one
// instruction: 16 output dimensions for two keys); the probabilities are rounded to bfloat16 for
// the value products, as the values are, and output dimensions come out in the order of
// VPUNPCK{L,H}WD, put back in order when written. Everything else (attend_rows_f32, at every
// level over vec.h): float32 math, keys transposed to [head_dim][64] floats, bfloat16 values
// widened as they load.
// Softmax is online (flash attention) in base 2; in the bfloat16 kernel the scale goes into the
// exponent's FMA and a row block's rescale factors are one vector exp (a libm exp2f per row and
// tile, and the spills its call forced: without them the kernel ran 1.4-1.6x faster), and each tile prefetches the
// next one's keys and values into L2 over its row blocks. head_dim must be a multiple of VL (16 with
// AVX-512, 8 below; 32 for the bfloat16 kernel); extend_attention returns 0 otherwise and the
// caller uses torch's SDPA.
//
// A sliding window: each query row sees keys [first, limit) (p - window < j <= p), an item's tiles
// start at its first row's first key (the pages before are never read), and the rows of a tile
// mask the keys before their own first (the whole-tile kernel only where every row sees it all).
// A soft-cap bends a tile's scores (cap * tanh(s / cap), in base 2) before its softmax.
//
// Layouts: q rows q_stride elements apart, the heads of a token at (h * G + g) * D in its row;
// out [T, H, D]; k, v caches "HND" [HKV, S, D]; tables [R, P] int32 page ids; per request r its
// first new token's row q_starts[r], prefix_lens[r] cached tokens and extend_lens[r] new ones
// (whose keys and values are already in the cache).
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "vec.h"

#define QB 16  // the fewest new tokens per work item (item_block)
#define QB_MAX 64  // the most
#define KT 64  // keys per tile
#define RB 4   // query rows computed together
#define RBF 6  // the same for the float32 kernel (24 accumulators)
#define EXT_MAX_ROWS (QB_MAX * 8)  // query rows per item (group up to 8)
#define EXT_MAX_D 256

typedef struct {
    int64_t r, h, i0, n;  // request, kv head, first new token of the block, tokens in it
    int64_t keys;         // keys its last token sees: its cost
} Item;

static int by_cost_desc(const void* a, const void* b) {  // the dearest first: dynamic scheduling evens out
    const Item* x = (const Item*)a;
    const Item* y = (const Item*)b;
    return (y->keys > x->keys) - (y->keys < x->keys);
}

// alpha[b] = 2^(m_old[b] - m_new[b]) for a row block's `rows` (<= VL) rows at once: how much the
// online softmax scales a row's sum and accumulators down by. Where m_old is still -inf it gives
// 2^-126, which scales zeros. (With AVX-512: masked loads and stores, and vexp2's polynomial.)
static inline void rescale_factors(const float* m_old, const float* m_new, float* alpha, int rows) {
    vf_store_n(alpha, vf_exp2(vf_sub(vf_load_n(m_old, rows), vf_load_n(m_new, rows))), rows);
}

// The keys of the tile [base, base + n) that a query row seeing keys [first, limit) sees: [*lo, hi)
// in the tile, hi returned; 0 (and *lo 0) where it sees none of them.
static inline int64_t tile_span(int64_t first, int64_t limit, int64_t base, int64_t n, int64_t* lo) {
    const int64_t from = first > base ? first - base : 0, to = limit - base < n ? limit - base : n;
    *lo = from < to ? from : 0;
    return from < to ? to : 0;
}

// The keys a prompt token at position pos sees: [*first, *limit) = [pos - window + 1, pos + 1)
// with a sliding window (window > 0: p - window < j <= p, as transformers), [0, pos + 1) without.
static inline void visible_keys(int64_t pos, int64_t window, int64_t* first, int64_t* limit) {
    *limit = pos + 1;
    *first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

// The factor a query row's accumulator is multiplied by at the end: 1 / l, or with a sink (gpt-oss: a
// learned logit per query head [H], in base 2 like m once scaled, that joins the softmax's denominator
// and attends no value) scale / (l * scale + 2^(sink - max)) over the larger of m and the sink. A row
// that saw no key gets 0.
static inline float row_inverse(float m, float l, const float* sinks, int64_t head) {
    if (!sinks) return l > 0.f ? 1.f / l : 0.f;
    const float sink = sinks[head] * 1.4426950408889634f;
    const float mx = m > sink ? m : sink;
    const float scale = exp2f(m - mx);  // 0 where m is -inf (no key)
    return scale / (l * scale + exp2f(sink - mx));
}

#if defined(__AVX512BF16__)
// Which lanes of vector w of a tile's scores (keys 16w to 16w + 15) lie in [lo, hi).
static inline __mmask16 span_mask(int64_t lo, int64_t hi, int64_t w) {
    return (__mmask16)(strip_mask(hi, w) & ~strip_mask(lo, w));
}

// sc[b][w]: the raw scores of query row b (bf16 pairs at qp[b]) against the tile's keys 16w to
// 16w + 15 (ktp: [D / 2][KT] pairs), for w < used.
static inline __attribute__((always_inline)) void tile_scores(const int64_t D, const int64_t used,
                                                              const uint32_t* const* qp, const uint32_t* ktp,
                                                              __m512 sc[RB][KT / 16]) {
    for (int64_t b = 0; b < RB; b++)
        for (int64_t w = 0; w < KT / 16; w++) sc[b][w] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < D / 2; dp++) {
        __m512bh qq[RB];
        for (int64_t b = 0; b < RB; b++) qq[b] = (__m512bh)_mm512_set1_epi32((int)qp[b][dp]);
        for (int64_t w = 0; w < used; w++) {
            const __m512bh kk = (__m512bh)_mm512_loadu_si512(ktp + dp * KT + w * 16);
            for (int64_t b = 0; b < RB; b++) sc[b][w] = _mm512_dpbf16_ps(sc[b][w], qq[b], kk);
        }
    }
}

// RB query rows that all see every key of a full tile (a cached prefix's tiles, most of them): what
// attend_rows does for a block, with every count known at compile time and no masks, so the scores
// and accumulators stay in registers (with the counts of a partial tile gcc spilled them).
// qp: the rows' queries as bf16 pairs; acc [RB, D] (VPUNPCK order), m, l [RB]: their state.
static inline __attribute__((always_inline)) void full_tile_rows(const int64_t D,
                                                                 const uint32_t* const* qp, const uint32_t* ktp,
                                                                 const uint32_t* vtp, float qscale, float cap2, float* m,
                                                                 float* l, float* acc) {
    __m512 sc[RB][KT / 16];
    tile_scores(D, KT / 16, qp, ktp, sc);
    if (cap2 > 0.f) {  // soft-capped, the scores come out in base 2: the softmax below scales them by 1
        for (int64_t b = 0; b < RB; b++)
            for (int64_t w = 0; w < KT / 16; w++) sc[b][w] = vf_soft_cap(sc[b][w], qscale, cap2);
        qscale = 1.f;
    }
    uint32_t pp[RB][KT / 2];
    float alpha[RB], mx[RB];
    for (int64_t b = 0; b < RB; b++) {
        __m512 mxv = sc[b][0];
        for (int64_t w = 1; w < KT / 16; w++) mxv = _mm512_max_ps(mxv, sc[b][w]);
        const float mx_tile = _mm512_reduce_max_ps(mxv) * qscale;  // qscale > 0: the max of the scaled scores
        mx[b] = mx_tile > m[b] ? mx_tile : m[b];
    }
    rescale_factors(m, mx, alpha, RB);
    for (int64_t b = 0; b < RB; b++) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t w = 0; w < KT / 16; w++) {
            const __m512 p = vexp2(_mm512_fmsub_ps(sc[b][w], _mm512_set1_ps(qscale), _mm512_set1_ps(mx[b])));
            sum = _mm512_add_ps(sum, p);
            _mm256_storeu_si256((__m256i*)(pp[b] + w * 8), vcvt_bf16_normal(p));
        }
        l[b] = l[b] * alpha[b] + _mm512_reduce_add_ps(sum);
        m[b] = mx[b];
    }
    for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {
        __m512 av[RB][4];
        for (int64_t b = 0; b < RB; b++)
            for (int64_t c = 0; c < 4; c++)
                av[b][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + b * D + (c0 + c) * 16), _mm512_set1_ps(alpha[b]));
        for (int64_t jp = 0; jp < KT / 2; jp++) {
            __m512bh pw[RB];
            for (int64_t b = 0; b < RB; b++) pw[b] = (__m512bh)_mm512_set1_epi32((int)pp[b][jp]);
            for (int64_t c = 0; c < 4; c++) {
                const __m512bh vv = (__m512bh)_mm512_loadu_si512(vtp + jp * D + (c0 + c) * 16);
                for (int64_t b = 0; b < RB; b++) av[b][c] = _mm512_dpbf16_ps(av[b][c], pw[b], vv);
            }
        }
        for (int64_t b = 0; b < RB; b++)
            for (int64_t c = 0; c < 4; c++) _mm512_storeu_ps(acc + b * D + (c0 + c) * 16, av[b][c]);
    }
}

// Keys *ahead to *ahead + share of those at offsets at[0, n) into L2, their values too.
static inline void prefetch_keys(const uint16_t* kh, const uint16_t* vh, const int64_t* at, int64_t* ahead,
                                 int64_t share, int64_t n, int64_t D) {
    const int64_t end = *ahead + share < n ? *ahead + share : n;
    for (int64_t j = *ahead; j < end; j++)
        for (int64_t c = 0; c < D; c += 32) {  // 64-byte lines of bfloat16
            __builtin_prefetch(kh + at[j] + c, 0, 2);
            __builtin_prefetch(vh + at[j] + c, 0, 2);
        }
    *ahead = end;
}

// A tile's n (<= KT) keys and values at element offsets row[] of a kv head's [S, D] block, laid out
// for the products: keys as ktp [D / 2][KT] pairs of dimensions (16 keys x 16 dim pairs at a time,
// transposed in registers), values as vtp [KT / 2][D] pairs of keys (VPUNPCK order); keys past n zero.
static void lay_out_tile(const uint16_t* kh, const uint16_t* vh, const int64_t* row, int64_t n, int64_t D,
                         uint32_t* ktp, uint32_t* vtp) {
    for (int64_t w = 0; w < KT / 16; w++)
        for (int64_t dpb = 0; dpb < D / 32; dpb++) {
            __m512i r[16];
            for (int64_t j = 0; j < 16; j++) {
                const int64_t key = w * 16 + j;
                r[j] = key < n ? _mm512_loadu_si512(kh + row[key] + dpb * 32) : _mm512_setzero_si512();
            }
            transpose16_epi32(r);
            for (int64_t i = 0; i < 16; i++) _mm512_storeu_si512(ktp + (dpb * 16 + i) * KT + w * 16, r[i]);
        }
    for (int64_t jp = 0; jp < KT / 2; jp++) {
        const int64_t j0 = 2 * jp, j1 = 2 * jp + 1;
        for (int64_t c = 0; c < D; c += 32) {
            const __m512i a = j0 < n ? _mm512_loadu_si512(vh + row[j0] + c) : _mm512_setzero_si512();
            const __m512i b = j1 < n ? _mm512_loadu_si512(vh + row[j1] + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(vtp + jp * D + c, _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512(vtp + jp * D + c + 16, _mm512_unpackhi_epi16(a, b));
        }
    }
}

#if HAVE_AMX
// One block of 16 query rows (qb: [16][D] bf16, rows past nr zero) over a laid-out tile on AMX: the
// scores are four C tiles (16 rows x 16 keys) summed over D in 32-dimension steps (A: the rows'
// queries, B: 16 dim pairs x 16 keys of ktp); then the online softmax over them in AVX-512, the
// probabilities rounded to bfloat16 into pb [16][KT]; then p . V four 16-dimension C tiles at a
// time (A: 32 keys' probabilities, B: 16 key pairs x 16 dims of vtp), added to acc scaled by alpha.
static void amx_row_block(const uint16_t* qb, const int64_t* lo, const int64_t* visible, int64_t nr,
                          const uint32_t* ktp, const uint32_t* vtp, int64_t D, float qscale, float cap2, float* m,
                          float* l, float* acc) {
    float sc[16 * KT] __attribute__((aligned(64)));
    uint16_t pb[16 * KT] __attribute__((aligned(64)));
    float part[16 * 16] __attribute__((aligned(64)));
    amx_zero_tiles_0_to_3();
    for (int64_t dc = 0; dc < D / 32; dc++) {
        _tile_loadd(4, qb + dc * 32, D * 2);
        _tile_loadd(5, ktp + dc * 16 * KT + 0 * 16, KT * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, ktp + dc * 16 * KT + 1 * 16, KT * 4);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, ktp + dc * 16 * KT + 2 * 16, KT * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, ktp + dc * 16 * KT + 3 * 16, KT * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, sc + 0 * 16, KT * 4);
    _tile_stored(1, sc + 1 * 16, KT * 4);
    _tile_stored(2, sc + 2 * 16, KT * 4);
    _tile_stored(3, sc + 3 * 16, KT * 4);
    if (cap2 > 0.f) {  // (as full_tile_rows)
        soft_cap(sc, nr * KT, qscale, cap2);
        qscale = 1.f;
    }
    float alpha[16], m_old[16], mx[16];
    for (int64_t b = 0; b < 16; b++) {  // each row's new max (rows that see nothing keep theirs)
        m_old[b] = mx[b] = b < nr ? m[b] : 0.f;
        if (visible[b] == 0) continue;
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        for (int64_t w = 0; w < KT / 16; w++)
            mxv = _mm512_mask_max_ps(mxv, span_mask(lo[b], visible[b], w), mxv, _mm512_loadu_ps(sc + b * KT + w * 16));
        const float mx_tile = _mm512_reduce_max_ps(mxv) * qscale;  // qscale > 0
        mx[b] = mx_tile > m_old[b] ? mx_tile : m_old[b];
    }
    rescale_factors(m_old, mx, alpha, 16);
    for (int64_t b = 0; b < 16; b++) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t w = 0; w < KT / 16; w++) {
            const __m512 s = _mm512_loadu_ps(sc + b * KT + w * 16);
            const __m512 p = _mm512_maskz_mov_ps(span_mask(lo[b], visible[b], w),
                                                 vexp2(_mm512_fmsub_ps(s, _mm512_set1_ps(qscale), _mm512_set1_ps(mx[b]))));
            sum = _mm512_add_ps(sum, p);
            _mm256_storeu_si256((__m256i*)(pb + b * KT + w * 16), vcvt_bf16_normal(p));
        }
        if (visible[b] == 0) {
            alpha[b] = 1.f;
            continue;
        }
        l[b] = l[b] * alpha[b] + _mm512_reduce_add_ps(sum);
        m[b] = mx[b];
    }
    for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {
        const int64_t nc = D / 16 - c0 < 4 ? D / 16 - c0 : 4;
        amx_zero_tiles_0_to_3();
        for (int64_t kc = 0; kc < KT / 32; kc++) {
            _tile_loadd(4, pb + kc * 32, KT * 2);
            const uint32_t* vb = vtp + kc * 16 * D + c0 * 16;
            _tile_loadd(5, vb, D * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (nc > 1) { _tile_loadd(5, vb + 16, D * 4); _tile_dpbf16ps(1, 4, 5); }
            if (nc > 2) { _tile_loadd(5, vb + 32, D * 4); _tile_dpbf16ps(2, 4, 5); }
            if (nc > 3) { _tile_loadd(5, vb + 48, D * 4); _tile_dpbf16ps(3, 4, 5); }
        }
        for (int64_t c = 0; c < nc; c++) {
            switch (c) {  // the tile index must be a constant
                case 0: _tile_stored(0, part, 64); break;
                case 1: _tile_stored(1, part, 64); break;
                case 2: _tile_stored(2, part, 64); break;
                default: _tile_stored(3, part, 64); break;
            }
            for (int64_t b = 0; b < nr; b++) {
                float* a = acc + b * D + (c0 + c) * 16;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(alpha[b]),
                                                    _mm512_loadu_ps(part + b * 16)));
            }
        }
    }
}

// attend_rows on AMX tiles (same arguments, same results up to the order of float sums): the query
// rows are copied once into blocks of 16 (the last one zero-padded), and every tile of keys is laid
// out as attend_rows lays it out, then each block of rows runs amx_row_block over it. Returns 0,
// having done nothing, where the copy of the rows cannot be allocated (attend_rows then runs).
static int attend_rows_amx(const uint16_t* const* qrows, const int64_t* first, const int64_t* limit, int64_t rows,
                           const uint16_t* kh, const uint16_t* vh, const int32_t* table, int64_t PS, int64_t k0,
                           int64_t k1, int64_t D, float qscale, float cap2, float* m, float* l, float* acc,
                           uint32_t* scratch) {
    uint32_t* ktp = scratch;
    uint32_t* vtp = ktp + D / 2 * KT;
    const int64_t blocks = (rows + 15) / 16;
    uint16_t* qb = (uint16_t*)calloc((size_t)(blocks * 16 * D), sizeof(uint16_t));
    if (!qb) return 0;
    for (int64_t r = 0; r < rows; r++) memcpy(qb + r * D, qrows[r], sizeof(uint16_t) * (size_t)D);
    amx_configure(6, 0, 16);  // 0-3: C, 4: A, 5: B
    int64_t row[KT];
    for (int64_t base = k0; base < k1; base += KT) {
        const int64_t n = k1 - base < KT ? k1 - base : KT;
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = base + j;
            row[j] = ((int64_t)table[t / PS] * PS + t % PS) * D;
        }
        lay_out_tile(kh, vh, row, n, D, ktp, vtp);
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t r0 = blk * 16, nr = rows - r0 < 16 ? rows - r0 : 16;
            int64_t lo[16], visible[16], seen = 0;
            for (int64_t b = 0; b < 16; b++) {  // the keys of this tile each row sees: [lo, visible)
                lo[b] = 0;
                visible[b] = b < nr ? tile_span(first[r0 + b], limit[r0 + b], base, n, &lo[b]) : 0;
                seen = visible[b] > seen ? visible[b] : seen;
            }
            if (seen)
                amx_row_block(qb + r0 * D, lo, visible, nr, ktp, vtp, D, qscale, cap2, m + r0, l + r0, acc + r0 * D);
        }
    }
    _tile_release();
    free(qb);
    return 1;
}
#endif

// Query rows (raw bfloat16, scores scaled by qscale in base 2, then soft-capped at cap2 where it is
// not 0) over keys [k0, k1) of one kv head, row r seeing keys [first[r], limit[r]) only (causal, and
// a sliding window); updates each row's online-softmax state m, l and acc [rows, D] (VPUNPCK
// order). scratch: D * KT uint32 for a tile's key and value pairs.
static void attend_rows(const uint16_t* const* qrows, const int64_t* first, const int64_t* limit, int64_t rows,
                        const uint16_t* kh, const uint16_t* vh, const int32_t* table, int64_t PS, int64_t k0,
                        int64_t k1, int64_t D, float qscale, float cap2, float* m, float* l, float* acc,
                        uint32_t* scratch) {
#if HAVE_AMX
    if (relay_gemm_amx_available() &&
        attend_rows_amx(qrows, first, limit, rows, kh, vh, table, PS, k0, k1, D, qscale, cap2, m, l, acc, scratch))
        return;
#endif
    const float qs = cap2 > 0.f ? 1.f : qscale;  // what the softmax scales the scores by (capped: scaled)
    const int64_t NC = D / 16;
    uint32_t* ktp = scratch;             // [D / 2][KT] key pairs of dims
    uint32_t* vtp = ktp + D / 2 * KT;    // [KT / 2][D] value pairs of keys (VPUNPCK order)
    int64_t row[KT], next[KT];  // element offset of each of the tile's (the next tile's) tokens in [S, D]
    const int64_t blocks = (rows + RB - 1) / RB;
    for (int64_t base = k0; base < k1; base += KT) {
        const int64_t n = k1 - base < KT ? k1 - base : KT;
        const int64_t n_next = k1 - base - n < KT ? k1 - base - n : KT;
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = base + j;
            row[j] = ((int64_t)table[t / PS] * PS + t % PS) * D;
        }
        for (int64_t j = 0; j < n_next; j++) {
            const int64_t t = base + n + j;
            next[j] = ((int64_t)table[t / PS] * PS + t % PS) * D;
        }
        // The next tile's keys and values stream into L2 while this one computes: each row block
        // asks for its share, so the misses never fill the queue at once.
        const int64_t share = (n_next + blocks - 1) / blocks;
        int64_t ahead = 0;
        lay_out_tile(kh, vh, row, n, D, ktp, vtp);
        // Query rows in blocks of RB: each loaded key or value vector serves RB rows. Blocks that
        // see the whole tile (all of them over a cached prefix) first, by the unmasked kernel.
        int64_t r0 = 0;
        if (n == KT && (D == 64 || D == 128)) {
            for (; r0 + RB <= rows; r0 += RB) {
                int full = 1;
                const uint32_t* qp[RB];
                for (int64_t b = 0; b < RB; b++) {
                    full &= limit[r0 + b] >= base + KT && first[r0 + b] <= base;
                    qp[b] = (const uint32_t*)qrows[r0 + b];
                }
                if (!full) break;
                prefetch_keys(kh, vh, next, &ahead, share, n_next, D);
                if (D == 64) full_tile_rows(64, qp, ktp, vtp, qscale, cap2, m + r0, l + r0, acc + r0 * D);
                else full_tile_rows(128, qp, ktp, vtp, qscale, cap2, m + r0, l + r0, acc + r0 * D);
            }
        }
        for (; r0 < rows; r0 += RB) {
            prefetch_keys(kh, vh, next, &ahead, share, n_next, D);
            const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
            int64_t lo[RB], visible[RB];  // the keys of this tile each row sees: [lo, visible)
            const uint32_t* qp[RB];
            int64_t used = 0;
            for (int64_t b = 0; b < RB; b++) {
                const int64_t rr = r0 + (b < nr ? b : 0);
                lo[b] = 0;
                visible[b] = b < nr ? tile_span(first[rr], limit[rr], base, n, &lo[b]) : 0;
                qp[b] = (const uint32_t*)qrows[rr];
                const int64_t u = (visible[b] + 15) / 16;
                used = u > used ? u : used;
            }
            if (used == 0) continue;
            __m512 sc[RB][KT / 16];
            tile_scores(D, used, qp, ktp, sc);
            if (cap2 > 0.f)
                for (int64_t b = 0; b < RB; b++)
                    for (int64_t w = 0; w < used; w++) sc[b][w] = vf_soft_cap(sc[b][w], qscale, cap2);
            uint32_t pp[RB][KT / 2];
            float alpha[RB], m_old[RB], mx[RB];
            for (int64_t b = 0; b < RB; b++) {  // each row's new max (rows that see nothing keep theirs)
                m_old[b] = mx[b] = m[r0 + (b < nr ? b : 0)];
                if (visible[b] == 0) continue;
                __m512 mxv = _mm512_set1_ps(-INFINITY);
                for (int64_t w = 0; w < used; w++)
                    mxv = _mm512_mask_max_ps(mxv, span_mask(lo[b], visible[b], w), mxv, sc[b][w]);
                const float mx_tile = _mm512_reduce_max_ps(mxv) * qs;  // qs > 0
                mx[b] = mx_tile > m_old[b] ? mx_tile : m_old[b];
            }
            rescale_factors(m_old, mx, alpha, RB);
            int64_t pairs = 0;
            for (int64_t b = 0; b < RB; b++) {
                memset(pp[b], 0, sizeof(pp[b]));
                if (visible[b] == 0) {
                    alpha[b] = 1.f;
                    continue;
                }
                const int64_t rr = r0 + b;
                __m512 sum = _mm512_setzero_ps();
                for (int64_t w = 0; w < used; w++) {
                    const __m512 p = _mm512_maskz_mov_ps(span_mask(lo[b], visible[b], w),
                                                         vexp2(_mm512_fmsub_ps(sc[b][w], _mm512_set1_ps(qs),
                                                                               _mm512_set1_ps(mx[b]))));
                    sum = _mm512_add_ps(sum, p);
                    _mm256_storeu_si256((__m256i*)(pp[b] + w * 8), vcvt_bf16_normal(p));  // keys 16w.. as 8 pairs
                }
                l[rr] = l[rr] * alpha[b] + _mm512_reduce_add_ps(sum);
                m[rr] = mx[b];
                const int64_t pr = (visible[b] + 1) / 2;
                pairs = pr > pairs ? pr : pairs;
            }
            // acc += p . V: 4 output chunks (64 dims) at a time so each broadcast weight pair serves
            // all of them and each value vector all RB rows.
            for (int64_t c0 = 0; c0 < NC; c0 += 4) {
                const int64_t nc = NC - c0 < 4 ? NC - c0 : 4;
                __m512 av[RB][4];
                for (int64_t b = 0; b < RB; b++)
                    for (int64_t c = 0; c < nc; c++)
                        av[b][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + (b < nr ? b : 0)) * D + (c0 + c) * 16),
                                                 _mm512_set1_ps(alpha[b]));
                for (int64_t jp = 0; jp < pairs; jp++) {
                    __m512bh pw[RB];
                    for (int64_t b = 0; b < RB; b++) pw[b] = (__m512bh)_mm512_set1_epi32((int)pp[b][jp]);
                    for (int64_t c = 0; c < nc; c++) {
                        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vtp + jp * D + (c0 + c) * 16);
                        for (int64_t b = 0; b < RB; b++) av[b][c] = _mm512_dpbf16_ps(av[b][c], pw[b], vv);
                    }
                }
                for (int64_t b = 0; b < nr; b++)
                    for (int64_t c = 0; c < nc; c++) _mm512_storeu_ps(acc + (r0 + b) * D + (c0 + c) * 16, av[b][c]);
            }
        }
    }
}

static void extend_item(const Item* it, const uint16_t* q, int64_t q_stride, const uint16_t* k, const uint16_t* v,
                        const int32_t* table, int64_t prefix, int64_t q_start, uint16_t* out, int64_t H, int64_t G,
                        int64_t D, int64_t S, int64_t PS, float qscale, int64_t window, float cap2,
                        const float* sinks, void* work) {
    const int64_t rows = it->n * G, NC = D / 16;
    float* acc = (float*)work;            // [rows, D] in VPUNPCK order
    float* m = acc + rows * D;            // [rows]
    float* l = m + rows;                  // [rows]
    uint32_t* scratch = (uint32_t*)(l + rows);
    const uint16_t* qrows[EXT_MAX_ROWS];
    int64_t first[EXT_MAX_ROWS], limit[EXT_MAX_ROWS];
    for (int64_t rr = 0; rr < rows; rr++) {
        const int64_t tok = it->i0 + rr / G;
        qrows[rr] = q + (q_start + tok) * q_stride + (it->h * G + rr % G) * D;
        visible_keys(prefix + tok, window, &first[rr], &limit[rr]);
        m[rr] = -INFINITY;
        l[rr] = 0.f;
    }
    memset(acc, 0, sizeof(float) * rows * D);
    attend_rows(qrows, first, limit, rows, k + it->h * S * D, v + it->h * S * D, table, PS, first[0],
                prefix + it->i0 + it->n, D, qscale, cap2, m, l, acc, scratch);
    for (int64_t rr = 0; rr < rows; rr++) {
        uint16_t* o = out + ((q_start + it->i0 + rr / G) * H + it->h * G + rr % G) * D;
        const __m512 inv = _mm512_set1_ps(row_inverse(m[rr], l[rr], sinks, it->h * G + rr % G));
        for (int64_t c = 0; c < NC; c += 2) {
            __m512 first, second;
            unpack_order32(_mm512_loadu_ps(acc + rr * D + c * 16), _mm512_loadu_ps(acc + rr * D + c * 16 + 16),
                           &first, &second);
            _mm256_storeu_si256((__m256i*)(o + c * 16), vcvt_bf16(_mm512_mul_ps(first, inv)));
            _mm256_storeu_si256((__m256i*)(o + c * 16 + 16), vcvt_bf16(_mm512_mul_ps(second, inv)));
        }
    }
}

// Decode queries of several requests that share their first `keys` tokens' pages (one table,
// `table`), for one kv head and the keys [k0, k1) of that shared prefix: one pass over those keys
// for all of them. Writes each query row's partial softmax state in decode_attention's layout:
// partial_rows[r] -> [acc (D, in order), m, l] for that row's head.
int relay_attend_shared(const uint16_t* const* qrows, const int64_t* first, int64_t rows, const uint16_t* kh,
                        const uint16_t* vh, const int32_t* table, int64_t PS, int64_t k0, int64_t k1, int64_t D,
                        float qscale, float cap2, float* const* acc_out, float* const* m_out, float* const* l_out) {
    if (D % 32 || D > EXT_MAX_D) return 0;
    float* work = (float*)malloc(sizeof(float) * (size_t)(rows * (D + 2)) + sizeof(uint32_t) * (size_t)(D * KT));
    float* acc = work;
    float* m = acc + rows * D;
    float* l = m + rows;
    int64_t* limit = (int64_t*)malloc(sizeof(int64_t) * (size_t)rows);
    for (int64_t rr = 0; rr < rows; rr++) { m[rr] = -INFINITY; l[rr] = 0.f; limit[rr] = k1; }
    memset(acc, 0, sizeof(float) * rows * D);
    attend_rows(qrows, first, limit, rows, kh, vh, table, PS, k0, k1, D, qscale, cap2, m, l, acc,
                (uint32_t*)(l + rows));
    for (int64_t rr = 0; rr < rows; rr++) {
        for (int64_t c = 0; c < D / 16; c += 2) {
            __m512 first, second;
            unpack_order32(_mm512_loadu_ps(acc + rr * D + c * 16), _mm512_loadu_ps(acc + rr * D + c * 16 + 16),
                           &first, &second);
            _mm512_storeu_ps(acc_out[rr] + c * 16, first);
            _mm512_storeu_ps(acc_out[rr] + c * 16 + 16, second);
        }
        *m_out[rr] = m[rr];
        *l_out[rr] = l[rr];
    }
    free(limit);
    free(work);
    return 1;
}
#else
int relay_attend_shared(const uint16_t* const* qrows, const int64_t* first, int64_t rows, const uint16_t* kh,
                        const uint16_t* vh, const int32_t* table, int64_t PS, int64_t k0, int64_t k1, int64_t D,
                        float qscale, float cap2, float* const* acc_out, float* const* m_out, float* const* l_out) {
    (void)qrows; (void)first; (void)rows; (void)kh; (void)vh; (void)table; (void)PS; (void)k0; (void)k1; (void)D;
    (void)qscale; (void)cap2; (void)acc_out; (void)m_out; (void)l_out;
    return 0;
}
#endif

// The float32 twin of attend_rows, for float32 caches and for CPUs without AVX512-BF16 (bfloat16
// values are widened as they load), one source for every level over vec.h's VL lanes (AVX-512: 16,
// AVX2 + FMA: 8, generic C: 8). qs [rows, D]: the query rows as floats, already scaled by qscale;
// acc comes out in order. A tile's keys are transposed once into kt [D][KT] (vf_transpose, VL x VL
// at a time) so a row's scores for VL keys are one FMA per dimension with no horizontal sums, and
// each loaded key or value vector serves RBF rows: a small GEMM per tile rather than a dot product
// per key, on register tiles of RBF rows x NW vectors (NW * VL keys over every dimension for the
// scores, NW * VL output dimensions over the keys for the values). The scores go through memory
// (sc) for the softmax, which runs without masks. Against the AVX-512 kernel it replaced (scores
// kept in registers, masked softmax), the same speed at AVX-512 (4 x 64 tokens over a 1,024-token
// prefix, 1 x 256 with none; head_dim 64 and 128; float32 and bfloat16 caches; 0.96-1.00x time).
#define NW (VL == 16 ? 4 : 2)  // 6 x 4 of AVX-512's 32 registers, 6 x 2 of AVX2's 16 (KT: a multiple of NW * VL)

// sc[b][j]: query row q[b] (RBF rows of D floats) against key j of the tile (kt [D][KT]), for the
// first `used` vectors of keys (rounded up to NW).
static inline __attribute__((always_inline)) void tile_scores_f32(const int64_t D, const float* const* q,
                                                                  const float* kt, int64_t used, float (*sc)[KT]) {
    for (int64_t w0 = 0; w0 < used; w0 += NW) {
        vf acc[RBF][NW];
        for (int64_t b = 0; b < RBF; b++)
            for (int64_t w = 0; w < NW; w++) acc[b][w] = vf_zero();
        for (int64_t d = 0; d < D; d++) {
            vf kk[NW];
            for (int64_t w = 0; w < NW; w++) kk[w] = vf_load(kt + d * KT + (w0 + w) * VL);
            for (int64_t b = 0; b < RBF; b++) {
                const vf qq = vf_set1(q[b][d]);
                for (int64_t w = 0; w < NW; w++) acc[b][w] = vf_fma(qq, kk[w], acc[b][w]);
            }
        }
        for (int64_t b = 0; b < RBF; b++)
            for (int64_t w = 0; w < NW; w++) vf_store(sc[b] + (w0 + w) * VL, acc[b][w]);
    }
}

// The largest of s[0, n).
static inline float row_max(const float* s, int64_t n) {
    vf top = vf_set1(-INFINITY);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) top = vf_max(top, vf_load(s + j));
    float mx = vf_hmax(top);
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

// s[lo, n) -> the softmax numerators 2^(s - mx) in place, and 0 below lo (keys before a sliding
// window) and from n up to `end` (a multiple of VL): the keys the row does not see, whose
// probabilities the value products read; returns their sum.
static inline float row_numerators(float* s, int64_t lo, int64_t n, int64_t end, float mx) {
    const vf mv = vf_set1(mx);
    vf sum = vf_zero();
    memset(s, 0, sizeof(float) * (size_t)lo);
    int64_t j = lo;
    for (; j + VL <= n; j += VL) {
        const vf p = vf_exp2(vf_sub(vf_load(s + j), mv));
        vf_store(s + j, p);
        sum = vf_add(sum, p);
    }
    float total = vf_sum(sum);
    if (j < n) {  // the last n - j
        vf_store_n(s + j, vf_exp2(vf_sub(vf_load_n(s + j, n - j), mv)), n - j);
        for (int64_t i = j; i < n; i++) total += s[i];
    }
    for (j = n; j + VL <= end; j += VL) vf_store(s + j, vf_zero());
    if (j < end) vf_store_n(s + j, vf_zero(), end - j);
    return total;
}

// acc [nr, D] (a row block's) = acc * alpha + p . V over the tile's first `seen` keys, for the NV
// vectors of output dimensions from vector c0 on (p: the block's probabilities).
static inline __attribute__((always_inline)) void value_block(const int64_t NV, const int64_t D, int64_t c0,
                                                              float (*p)[KT], const float* alpha, const int64_t* row,
                                                              int64_t seen, const void* vh, int kv_bf16, float* acc,
                                                              int64_t nr) {
    vf av[RBF][NW];
    for (int64_t b = 0; b < RBF; b++)
        for (int64_t c = 0; c < NV; c++)
            av[b][c] = vf_mul(vf_load(acc + (b < nr ? b : 0) * D + (c0 + c) * VL), vf_set1(alpha[b]));
    for (int64_t j = 0; j < seen; j++) {
        vf vv[NW];  // the values first, then one weight at a time (all RBF weights first spilled on AVX2)
        for (int64_t c = 0; c < NV; c++) vv[c] = vf_load_act((const char*)vh + row[j], (c0 + c) * VL, kv_bf16);
        for (int64_t b = 0; b < RBF; b++) {
            const vf pw = vf_set1(p[b][j]);
            for (int64_t c = 0; c < NV; c++) av[b][c] = vf_fma(pw, vv[c], av[b][c]);
        }
    }
    for (int64_t b = 0; b < nr; b++)
        for (int64_t c = 0; c < NV; c++) vf_store(acc + b * D + (c0 + c) * VL, av[b][c]);
}

// Query rows qs over keys [k0, k1) of one kv head, row r seeing keys [first[r], limit[r]) only
// (causal, and a sliding window), its scores soft-capped at cap2 where that is not 0; updates each
// row's online-softmax state m, l and acc [rows, D]. kt: D * KT floats. NC
// (head_dim / VL) and kv_bf16 are compile-time constants in each instance (attend_rows_f32 below),
// so the accumulators of a row block stay in registers: with a runtime NC the compiler kept them
// on the stack and copied them out with rep movs (5 % of the AVX-512 kernel's time).
static inline __attribute__((always_inline)) void attend_rows_f32_nc(
        const int64_t NC, const float* qs, const int64_t* first, const int64_t* limit, int64_t rows, const void* kh,
        const void* vh, int kv_bf16, const int32_t* table, int64_t PS, int64_t k0, int64_t k1, float cap2, float* m,
        float* l, float* acc, float* kt) {
    const int64_t D = NC * VL;
    const size_t esz = kv_bf16 ? 2 : 4;
    int64_t row[KT];  // byte offset of each of the tile's tokens in a kv head's [S, D] block
    for (int64_t base = k0; base < k1; base += KT) {
        const int64_t n = k1 - base < KT ? k1 - base : KT;
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = base + j;
            row[j] = ((int64_t)table[t / PS] * PS + t % PS) * D * (int64_t)esz;
        }
        for (int64_t w = 0; w < KT / VL; w++)  // keys past n: zeros
            for (int64_t dc = 0; dc < NC; dc++) {
                vf r[VL];
                for (int64_t j = 0; j < VL; j++) {
                    const int64_t key = w * VL + j;
                    r[j] = key < n ? vf_load_act((const char*)kh + row[key], dc * VL, kv_bf16) : vf_zero();
                }
                vf_transpose(r);
                for (int64_t i = 0; i < VL; i++) vf_store(kt + (dc * VL + i) * KT + w * VL, r[i]);
            }
        for (int64_t r0 = 0; r0 < rows; r0 += RBF) {
            const int64_t nr = rows - r0 < RBF ? rows - r0 : RBF;
            int64_t lo[RBF], visible[RBF], seen = 0;  // the keys of this tile each row sees: [lo, visible)
            const float* q[RBF];
            for (int64_t b = 0; b < RBF; b++) {
                lo[b] = 0;
                visible[b] = b < nr ? tile_span(first[r0 + b], limit[r0 + b], base, n, &lo[b]) : 0;
                seen = visible[b] > seen ? visible[b] : seen;
                q[b] = qs + (r0 + (b < nr ? b : 0)) * D;
            }
            if (seen == 0) continue;
            const int64_t used = (seen + VL - 1) / VL;
            float sc[RBF][KT] __attribute__((aligned(64)));
            tile_scores_f32(D, q, kt, used, sc);
            float alpha[RBF], m_old[RBF], mx[RBF];
            for (int64_t b = 0; b < RBF; b++) {  // each row's new max (rows that see nothing keep theirs)
                m_old[b] = mx[b] = m[r0 + (b < nr ? b : 0)];
                if (visible[b] == 0) continue;
                if (cap2 > 0.f) soft_cap(sc[b] + lo[b], visible[b] - lo[b], 1.f, cap2);
                const float mx_tile = row_max(sc[b] + lo[b], visible[b] - lo[b]);
                mx[b] = mx_tile > m_old[b] ? mx_tile : m_old[b];
            }
            rescale_factors(m_old, mx, alpha, RBF);
            for (int64_t b = 0; b < RBF; b++) {  // sc -> probabilities (0 where a row sees no key)
                if (visible[b] == 0) {
                    alpha[b] = 1.f;
                    memset(sc[b], 0, sizeof(float) * (size_t)(used * VL));
                    continue;
                }
                const int64_t rr = r0 + b;
                l[rr] = l[rr] * alpha[b] + row_numerators(sc[b], lo[b], visible[b], used * VL, mx[b]);
                m[rr] = mx[b];
            }
            int64_t c0 = 0;  // acc += p . V, NW * VL output dims at a time (a count gcc knows: no spills)
            for (; c0 + NW <= NC; c0 += NW) value_block(NW, D, c0, sc, alpha, row, seen, vh, kv_bf16, acc + r0 * D, nr);
            for (; c0 < NC; c0++) value_block(1, D, c0, sc, alpha, row, seen, vh, kv_bf16, acc + r0 * D, nr);
        }
    }
}

static void attend_rows_f32(const float* qs, const int64_t* first, const int64_t* limit, int64_t rows, const void* kh,
                            const void* vh, int kv_bf16, const int32_t* table, int64_t PS, int64_t k0, int64_t k1,
                            int64_t D, float cap2, float* m, float* l, float* acc, float* kt) {
#define ROWS_F32(NCV, KV) \
    attend_rows_f32_nc(NCV, qs, first, limit, rows, kh, vh, KV, table, PS, k0, k1, cap2, m, l, acc, kt)
    // the cache's dtype a constant too: with a test of kv_bf16 at every load the value products spilled
    switch (D) {
        case 64: if (kv_bf16) ROWS_F32(64 / VL, 1); else ROWS_F32(64 / VL, 0); return;
        case 128: if (kv_bf16) ROWS_F32(128 / VL, 1); else ROWS_F32(128 / VL, 0); return;
        default: ROWS_F32(D / VL, kv_bf16);
    }
#undef ROWS_F32
}

// Query row i (float32 or bfloat16) as floats times qscale into qs [i, D] (D a multiple of VL).
static void scaled_rows(const void* const* qrows, int64_t rows, int64_t D, int io_bf16, float qscale, float* qs) {
    for (int64_t rr = 0; rr < rows; rr++)
        for (int64_t c = 0; c < D; c += VL)
            vf_store(qs + rr * D + c, vf_mul(vf_load_act(qrows[rr], c, io_bf16), vf_set1(qscale)));
}

// extend_item's float32 twin: out rows in the queries' dtype.
static void extend_item_f32(const Item* it, const void* q, int64_t q_stride, const void* k, const void* v,
                            int io_bf16, int kv_bf16, const int32_t* table, int64_t prefix, int64_t q_start, void* out,
                            int64_t H, int64_t G, int64_t D, int64_t S, int64_t PS, float qscale, int64_t window,
                            float cap2, const float* sinks, float* work) {
    const int64_t rows = it->n * G;
    const size_t qsz = io_bf16 ? 2 : 4, ksz = kv_bf16 ? 2 : 4;
    float* acc = work;             // [rows, D]
    float* qs = acc + rows * D;    // [rows, D]
    float* m = qs + rows * D;      // [rows]
    float* l = m + rows;           // [rows]
    float* kt = l + rows;          // [D, KT]
    const void* qrows[EXT_MAX_ROWS];
    int64_t first[EXT_MAX_ROWS], limit[EXT_MAX_ROWS];
    for (int64_t rr = 0; rr < rows; rr++) {
        const int64_t tok = it->i0 + rr / G;
        qrows[rr] = (const char*)q + ((q_start + tok) * q_stride + (it->h * G + rr % G) * D) * qsz;
        visible_keys(prefix + tok, window, &first[rr], &limit[rr]);
        m[rr] = -INFINITY;
        l[rr] = 0.f;
    }
    scaled_rows(qrows, rows, D, io_bf16, qscale, qs);
    memset(acc, 0, sizeof(float) * rows * D);
    attend_rows_f32(qs, first, limit, rows, (const char*)k + it->h * S * D * ksz,
                    (const char*)v + it->h * S * D * ksz, kv_bf16, table, PS, first[0], prefix + it->i0 + it->n, D,
                    cap2, m, l, acc, kt);
    for (int64_t rr = 0; rr < rows; rr++) {
        const int64_t o = ((q_start + it->i0 + rr / G) * H + it->h * G + rr % G) * D;
        const float inv = row_inverse(m[rr], l[rr], sinks, it->h * G + rr % G);
        for (int64_t d = 0; d < D; d++) {
            const float x = acc[rr * D + d] * inv;
            if (io_bf16) ((uint16_t*)out)[o + d] = f32_to_bf16(x);
            else ((float*)out)[o + d] = x;
        }
    }
}

// relay_attend_shared for float32 (or bfloat16 without AVX512-BF16) queries and caches, with
// attend_rows_f32; acc_out rows come out in order. Returns 0 where head_dim is not whole vectors.
int relay_attend_shared_f32(const void* const* qrows, int io_bf16, const int64_t* first, int64_t rows, const void* kh,
                            const void* vh, int kv_bf16, const int32_t* table, int64_t PS, int64_t k0, int64_t k1,
                            int64_t D, float qscale, float cap2, float* const* acc_out, float* const* m_out,
                            float* const* l_out) {
    if (D % VL || D > EXT_MAX_D) return 0;
    float* work = (float*)malloc(sizeof(float) * (size_t)(rows * (2 * D + 2) + D * KT));
    float* acc = work;
    float* qs = acc + rows * D;
    float* m = qs + rows * D;
    float* l = m + rows;
    int64_t* limit = (int64_t*)malloc(sizeof(int64_t) * (size_t)rows);
    for (int64_t rr = 0; rr < rows; rr++) { m[rr] = -INFINITY; l[rr] = 0.f; limit[rr] = k1; }
    scaled_rows(qrows, rows, D, io_bf16, qscale, qs);
    memset(acc, 0, sizeof(float) * rows * D);
    attend_rows_f32(qs, first, limit, rows, kh, vh, kv_bf16, table, PS, k0, k1, D, cap2, m, l, acc, l + rows);
    for (int64_t rr = 0; rr < rows; rr++) {
        memcpy(acc_out[rr], acc + rr * D, sizeof(float) * (size_t)D);
        *m_out[rr] = m[rr];
        *l_out[rr] = l[rr];
    }
    free(limit);
    free(work);
    return 1;
}

// Which query/cache dtypes extend_attention and the cascade (relay_attend_shared*) take here:
// float32 (bfloat16 widened) at every level, head_dim whole vectors (VL: 16 with AVX-512, else 8);
// bfloat16 with both bfloat16 on VDPBF16PS where the CPU has AVX512-BF16 and head_dim is pairs of
// 16 (the float tiles for the rest, so every head_dim of whole vectors is taken in every dtype).
int relay_tiled_attention_available(int io_bf16, int kv_bf16, int64_t D) {
    (void)io_bf16; (void)kv_bf16;  // (VDPBF16PS where both are bfloat16 and head_dim pairs of 16, else float)
    return D % VL == 0 && D <= EXT_MAX_D;
}

// Work items when each covers up to qb of a request's new tokens, per kv head.
static int64_t count_items(const int64_t* extend_lens, int64_t R, int64_t HKV, int64_t qb) {
    int64_t items = 0;
    for (int64_t r = 0; r < R; r++) items += HKV * ((extend_lens[r] + qb - 1) / qb);
    return items;
}

// Tokens per work item. An item's query rows share every 64-key tile it reads and lays out, so
// more of them pay (float32, 4 x 64 tokens over a 1,024-token prefix: 16 -> 32 tokens 1.13x,
// 32 -> 64 another 1.12x; bfloat16 16 -> 64 1.04-1.11x), while there are items enough to keep
// every thread busy.
static int64_t item_block(const int64_t* extend_lens, int64_t R, int64_t HKV) {
    const int64_t want = 4 * (int64_t)omp_get_max_threads();
    for (int64_t qb = QB_MAX; qb > QB; qb /= 2)
        if (count_items(extend_lens, R, HKV, qb) >= want) return qb;
    return QB;
}

int extend_attention(const void* q, int64_t q_stride, const void* k, const void* v, const int32_t* tables,
                     int64_t P, const int64_t* q_starts, const int64_t* prefix_lens, const int64_t* extend_lens,
                     int64_t R, void* out, int64_t H, int64_t HKV, int64_t D, int64_t S, int64_t PS, float scale,
                     int io_bf16, int kv_bf16, int64_t window, float softcap, const float* sinks) {
    const int64_t G = H / HKV;
#if defined(__AVX512BF16__)
    // VDPBF16PS on the raw values; a head_dim of an odd number of 16s takes the float tiles
    const int bf16 = io_bf16 && kv_bf16 && D % 32 == 0;
#else
    const int bf16 = 0;
#endif
    const int64_t qb = item_block(extend_lens, R, HKV);
    if (qb * G > EXT_MAX_ROWS || D > EXT_MAX_D || D % (bf16 ? 32 : VL)) return 0;
    const int64_t count = count_items(extend_lens, R, HKV, qb);
    Item* items = (Item*)malloc(sizeof(Item) * (count ? count : 1));
    int64_t c = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < HKV; h++)
            for (int64_t i0 = 0; i0 < extend_lens[r]; i0 += qb) {
                const int64_t n = extend_lens[r] - i0 < qb ? extend_lens[r] - i0 : qb;
                const int64_t keys = prefix_lens[r] + i0 + n;  // (a window bounds them)
                Item it = {r, h, i0, n, window > 0 && keys > window + n ? window + n : keys};
                items[c++] = it;
            }
    qsort(items, (size_t)count, sizeof(Item), by_cost_desc);
    const float qscale = scale * 1.4426950408889634f;
    const float cap2 = softcap > 0.f ? softcap * 1.4426950408889634f : 0.f;  // the cap in base 2 too
    const size_t work_bytes = bf16 ? sizeof(float) * (size_t)(qb * G * (D + 2)) + sizeof(uint32_t) * (size_t)(D * KT)
                                   : sizeof(float) * (size_t)(qb * G * (2 * D + 2) + D * KT);
    _Pragma("omp parallel")
    {
        void* work = malloc(work_bytes + 64);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t i = 0; i < count; i++) {
            const Item* it = items + i;
#if defined(__AVX512BF16__)
            if (bf16) {
                extend_item(it, (const uint16_t*)q, q_stride, (const uint16_t*)k, (const uint16_t*)v, tables + it->r * P,
                            prefix_lens[it->r], q_starts[it->r], (uint16_t*)out, H, G, D, S, PS, qscale, window, cap2,
                            sinks, work);
                continue;
            }
#endif
            extend_item_f32(it, q, q_stride, k, v, io_bf16, kv_bf16, tables + it->r * P, prefix_lens[it->r],
                            q_starts[it->r], out, H, G, D, S, PS, qscale, window, cap2, sinks, (float*)work);
        }
        free(work);
    }
    free(items);
    return 1;
}
