// Paged attention of prompt chunks for CPUs with AVX512-BF16: each request's new tokens over its
// cached prefix and themselves (causal), reading the bfloat16 KV cache in place.
//
// A work item is (request, kv head, block of up to 16 new tokens): its 16 x G query rows share
// every tile of 64 keys they read. A tile is laid out once per item for VDPBF16PS: keys as
// [head_dim / 2][64] pairs of dimensions (one instruction: 16 keys' scores for two dimensions of
// a query row, no horizontal sums), values as [32 key pairs][head_dim] pairs of keys (one
// instruction: 16 output dimensions for two keys). Softmax is online (flash attention) in base
// 2; the probabilities are rounded to bfloat16 for the value products, as the values are.
// Output dimensions come out of the value products in the order of VPUNPCK{L,H}WD and are put
// back in order when written. Only bfloat16 queries, keys and values with head_dim a multiple
// of 32 take this kernel (extend_attention returns 0 otherwise: the caller uses torch's SDPA).
//
// Layouts: q rows q_stride elements apart, the heads of a token at (h * G + g) * D in its row;
// out [T, H, D]; k, v caches "HND" [HKV, S, D]; tables [R, P] int32 page ids; per request r its
// first new token's row q_starts[r], prefix_lens[r] cached tokens and extend_lens[r] new ones
// (whose keys and values are already in the cache).
#include <stdlib.h>

#include "simd.h"

#define QB 16  // new tokens per work item
#define KT 64  // keys per tile
#define RB 4   // query rows computed together
#define EXT_MAX_ROWS (QB * 8)  // query rows per item (group up to 8)
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

#if defined(__AVX512BF16__)
// Query rows (raw bfloat16, scores scaled by qscale in base 2) over keys [k0, k1) of one kv head,
// each row seeing keys below its own limit[r] only; updates each row's online-softmax state m, l
// and acc [rows, D] (VPUNPCK order). scratch: D * KT uint32 for a tile's key and value pairs.
static void attend_rows(const uint16_t* const* qrows, const int64_t* limit, int64_t rows, const uint16_t* kh,
                        const uint16_t* vh, const int32_t* table, int64_t PS, int64_t k0, int64_t k1, int64_t D,
                        float qscale, float* m, float* l, float* acc, uint32_t* scratch) {
    const int64_t NC = D / 16;
    uint32_t* ktp = scratch;             // [D / 2][KT] key pairs of dims
    uint32_t* vtp = ktp + D / 2 * KT;    // [KT / 2][D] value pairs of keys (VPUNPCK order)
    int64_t row[KT];  // element offset of each of the tile's tokens in a kv head's [S, D] block
    for (int64_t base = k0; base < k1; base += KT) {
        const int64_t n = k1 - base < KT ? k1 - base : KT;
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = base + j;
            row[j] = ((int64_t)table[t / PS] * PS + t % PS) * D;
        }
        // Keys: 16 keys x 16 dim pairs at a time, transposed in registers.
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
        // Query rows in blocks of RB: each loaded key or value vector serves RB rows.
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
            int64_t visible[RB];
            const uint32_t* qp[RB];
            int64_t used = 0;
            for (int64_t b = 0; b < RB; b++) {
                const int64_t rr = r0 + (b < nr ? b : 0);
                const int64_t vis = limit[rr] - base;  // keys of this tile the row sees
                visible[b] = b < nr ? (vis < n ? (vis > 0 ? vis : 0) : n) : 0;
                qp[b] = (const uint32_t*)qrows[rr];
                const int64_t u = (visible[b] + 15) / 16;
                used = u > used ? u : used;
            }
            if (used == 0) continue;
            __m512 sc[RB][KT / 16];
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
            uint32_t pp[RB][KT / 2];
            float alpha[RB];
            int64_t pairs = 0;
            for (int64_t b = 0; b < RB; b++) {
                alpha[b] = 1.f;
                memset(pp[b], 0, sizeof(pp[b]));
                if (visible[b] == 0) continue;
                const int64_t rr = r0 + b;
                __m512 mxv = _mm512_set1_ps(-INFINITY);
                for (int64_t w = 0; w < used; w++) {
                    const int64_t left = visible[b] - w * 16;
                    const __mmask16 live = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
                    sc[b][w] = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY),
                                                    _mm512_mul_ps(sc[b][w], _mm512_set1_ps(qscale)));
                    mxv = _mm512_max_ps(mxv, sc[b][w]);
                }
                const float mx_tile = _mm512_reduce_max_ps(mxv);
                const float mx = mx_tile > m[rr] ? mx_tile : m[rr];
                alpha[b] = exp2f(m[rr] - mx);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t w = 0; w < used; w++) {
                    const int64_t left = visible[b] - w * 16;
                    const __mmask16 live = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
                    const __m512 p = _mm512_maskz_mov_ps(live, vexp2(_mm512_sub_ps(sc[b][w], _mm512_set1_ps(mx))));
                    sum = _mm512_add_ps(sum, p);
                    _mm256_storeu_si256((__m256i*)(pp[b] + w * 8), vcvt_bf16(p));  // keys 16w.. as 8 pairs
                }
                l[rr] = l[rr] * alpha[b] + _mm512_reduce_add_ps(sum);
                m[rr] = mx;
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
                        int64_t D, int64_t S, int64_t PS, float qscale, void* work) {
    const int64_t rows = it->n * G, NC = D / 16;
    float* acc = (float*)work;            // [rows, D] in VPUNPCK order
    float* m = acc + rows * D;            // [rows]
    float* l = m + rows;                  // [rows]
    uint32_t* scratch = (uint32_t*)(l + rows);
    const uint16_t* qrows[QB * 8];
    int64_t limit[QB * 8];
    for (int64_t rr = 0; rr < rows; rr++) {
        const int64_t tok = it->i0 + rr / G;
        qrows[rr] = q + (q_start + tok) * q_stride + (it->h * G + rr % G) * D;
        limit[rr] = prefix + tok + 1;  // causal: keys [0, position]
        m[rr] = -INFINITY;
        l[rr] = 0.f;
    }
    memset(acc, 0, sizeof(float) * rows * D);
    attend_rows(qrows, limit, rows, k + it->h * S * D, v + it->h * S * D, table, PS, 0, prefix + it->i0 + it->n, D,
                qscale, m, l, acc, scratch);
    for (int64_t rr = 0; rr < rows; rr++) {
        uint16_t* o = out + ((q_start + it->i0 + rr / G) * H + it->h * G + rr % G) * D;
        const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
        for (int64_t c = 0; c < NC; c++)
            for (int64_t i = 0; i < 16; i++) o[dim_of(c, i)] = f32_to_bf16(acc[rr * D + c * 16 + i] * inv);
    }
}

// Decode queries of several requests that share their first `keys` tokens' pages (one table,
// `table`), for one kv head and the keys [k0, k1) of that shared prefix: one pass over those keys
// for all of them. Writes each query row's partial softmax state in decode_attention's layout:
// partial_rows[r] -> [acc (D, in order), m, l] for that row's head.
int relay_attend_shared(const uint16_t* const* qrows, int64_t rows, const uint16_t* kh, const uint16_t* vh,
                        const int32_t* table, int64_t PS, int64_t k0, int64_t k1, int64_t D, float qscale,
                        float* const* acc_out, float* const* m_out, float* const* l_out) {
    if (D % 32 || D > EXT_MAX_D) return 0;
    float* work = (float*)malloc(sizeof(float) * (size_t)(rows * (D + 2)) + sizeof(uint32_t) * (size_t)(D * KT));
    float* acc = work;
    float* m = acc + rows * D;
    float* l = m + rows;
    int64_t* limit = (int64_t*)malloc(sizeof(int64_t) * (size_t)rows);
    for (int64_t rr = 0; rr < rows; rr++) { m[rr] = -INFINITY; l[rr] = 0.f; limit[rr] = k1; }
    memset(acc, 0, sizeof(float) * rows * D);
    attend_rows(qrows, limit, rows, kh, vh, table, PS, k0, k1, D, qscale, m, l, acc, (uint32_t*)(l + rows));
    for (int64_t rr = 0; rr < rows; rr++) {
        for (int64_t c = 0; c < D / 16; c++)
            for (int64_t i = 0; i < 16; i++) acc_out[rr][dim_of(c, i)] = acc[rr * D + c * 16 + i];
        *m_out[rr] = m[rr];
        *l_out[rr] = l[rr];
    }
    free(limit);
    free(work);
    return 1;
}
#else
int relay_attend_shared(const uint16_t* const* qrows, int64_t rows, const uint16_t* kh, const uint16_t* vh,
                        const int32_t* table, int64_t PS, int64_t k0, int64_t k1, int64_t D, float qscale,
                        float* const* acc_out, float* const* m_out, float* const* l_out) {
    (void)qrows; (void)rows; (void)kh; (void)vh; (void)table; (void)PS; (void)k0; (void)k1; (void)D; (void)qscale;
    (void)acc_out; (void)m_out; (void)l_out;
    return 0;
}
#endif

int extend_attention(const void* q, int64_t q_stride, const void* k, const void* v, const int32_t* tables,
                     int64_t P, const int64_t* q_starts, const int64_t* prefix_lens, const int64_t* extend_lens,
                     int64_t R, void* out, int64_t H, int64_t HKV, int64_t D, int64_t S, int64_t PS, float scale,
                     int io_bf16, int kv_bf16) {
#if defined(__AVX512BF16__)
    const int64_t G = H / HKV;
    if (!io_bf16 || !kv_bf16 || QB * G > EXT_MAX_ROWS || D > EXT_MAX_D || D % 32) return 0;
    int64_t count = 0;
    for (int64_t r = 0; r < R; r++) count += HKV * ((extend_lens[r] + QB - 1) / QB);
    Item* items = (Item*)malloc(sizeof(Item) * (count ? count : 1));
    int64_t c = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < HKV; h++)
            for (int64_t i0 = 0; i0 < extend_lens[r]; i0 += QB) {
                const int64_t n = extend_lens[r] - i0 < QB ? extend_lens[r] - i0 : QB;
                Item it = {r, h, i0, n, prefix_lens[r] + i0 + n};
                items[c++] = it;
            }
    qsort(items, (size_t)count, sizeof(Item), by_cost_desc);
    const float qscale = scale * 1.4426950408889634f;
    const size_t work_bytes = sizeof(float) * (size_t)(QB * G * (D + 2)) + sizeof(uint32_t) * (size_t)(D * KT);
    (void)EXT_MAX_ROWS;
    _Pragma("omp parallel")
    {
        void* work = malloc(work_bytes + 64);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t i = 0; i < count; i++) {
            const Item* it = items + i;
            extend_item(it, (const uint16_t*)q, q_stride, (const uint16_t*)k, (const uint16_t*)v, tables + it->r * P,
                        prefix_lens[it->r], q_starts[it->r], (uint16_t*)out, H, G, D, S, PS, qscale, work);
        }
        free(work);
    }
    free(items);
    return 1;
#else
    (void)q; (void)q_stride; (void)k; (void)v; (void)tables; (void)P; (void)q_starts; (void)prefix_lens;
    (void)extend_lens; (void)R; (void)out; (void)H; (void)HKV; (void)D; (void)S; (void)PS; (void)scale;
    (void)io_bf16; (void)kv_bf16;
    return 0;
#endif
}
