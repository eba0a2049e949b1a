// A whole decode step's decoder layers in one call, for models whose GEMM weights are all GGUF
// blocks (relay/execution/weight_blocks.py), in float32 activations: the same kernels, in the same order, on
// the same buffers as the Python layers of a float32 model call them one by one, so where those
// read the blocks too the output is bit for bit theirs (a bfloat16 model's layers keep bfloat16
// activations between kernels, this call float32 ones: close, not equal). What
// it removes is the interpreter between them: ~8 kernel calls per layer through torch modules
// and ctypes cost ~5 ms of a ~17 ms batch-1 step on a 2-core Xeon, while the other core waits.
// relay_prompt_layers (below) does the same for steps with prompt chunks of a bfloat16 model.
#include <stddef.h>
#include <stdint.h>
#include <string.h>

int relay_gemm_blocks(int bits, const uint8_t* q, const float* d, const float* m, const float* x, int64_t x_stride,
                      float* y, int64_t y_stride, int64_t M, int64_t N, int64_t K, int round_bf16);
int relay_gemm_bf16_panels(const void* x, int64_t x_stride, int x_f32, const uint32_t* panels, const uint16_t* bias,
                           void* y, int64_t y_stride, int y_f32, int64_t M, int64_t N, int64_t K);
void relay_rms_norm(const void* x, void* residual, const void* w, void* out, int64_t T, int64_t H, float eps,
                    int bf16);
void relay_rope(void* qkv, const float* cos, const float* sin, const int64_t* positions, int64_t T, int64_t stride,
                int64_t nq, int64_t nk, int64_t D, int bf16);
void relay_silu_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16);
void relay_gelu_tanh_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16);
void relay_head_norm(void* qkv, const void* qw, const void* kw, int64_t T, int64_t stride, int64_t nq, int64_t nk,
                     int64_t D, float eps, int bf16);
typedef struct ShmGroup ShmGroup;  // shm_collective.c
int relay_shm_all_reduce(ShmGroup* g, void* data, int64_t n, int bf16);
void decode_attention(const void* q, int64_t q_stride, const void* new_k, int64_t k_stride, const void* new_v,
                      int64_t v_stride, void* k, void* v, const int32_t* tables, const int64_t* lens,
                      const int64_t* order, void* out, int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t S,
                      int64_t P, int64_t PS, int64_t chunk, float scale, int io_bf16, int kv_bf16,
                      int64_t window, float softcap, int64_t n_groups, const int64_t* group_first,
                      const int64_t* group_size, const int64_t* group_keys, const float* sinks);

typedef struct {  // a [n, k] weight in blocks (BlockWeight) and maybe bfloat16 panels (cpu_layers.LayerGemm)
    int64_t bits;
    const uint8_t* q;
    const float* d;
    const float* m;
    int64_t n, k;
    int64_t round_bf16;  // a bfloat16 model's weights (BlockWeight.round_bf16)
    const uint32_t* panels;  // the bfloat16 model's Bf16Panels, or NULL
    int64_t blocks_max_rows;  // with panels, GEMMs of more rows than this read those
} LayerGemm;

typedef struct {
    const float* input_norm;
    const float* post_norm;  // after attention: Llama's before the MLP (with the residual add), Gemma's on
                             // the attention's output alone
    LayerGemm qkv, o, gate_up, down;
    void* k_cache;  // [HKV, S, D]
    void* v_cache;
    const float* q_norm;  // [D]: each q and k head normalised before the rotary embedding (Qwen3, Gemma 3),
    const float* k_norm;  // or NULL
    // Gemma's sandwich: the norm before the MLP (with the residual add) and the one on its output alone;
    // NULL: Llama's layer (post_norm is the one before the MLP)
    const float* pre_mlp_norm;
    const float* post_mlp_norm;
    const float* cos;  // this layer's rotary tables (Gemma 3's sliding layers have their own base)
    const float* sin;
} DecodeLayer;

typedef struct {  // one step: T requests, one new token each
    int64_t T, hidden, inter, nq, nk, D;
    float eps, scale;
    const int64_t* positions;  // [T]
    // decode_attention's plan (cpu_attention.DecodePlan) and cache geometry
    const int32_t* tables;
    const int64_t* lens;
    const int64_t* order;
    int64_t P, S, PS, chunk, kv_bf16, n_groups;
    const int64_t* group_first;
    const int64_t* group_size;
    const int64_t* group_keys;
    const float* final_norm;
    // x [T, hidden]: the embeddings in, the residual stream while running; out [T, hidden]: the
    // final norm's output; scratch qkv [T, qkv.n], attn [T, nq * D], gate_up [T, 2 * inter],
    // act [T, inter]
    float *x, *out, *qkv, *attn, *gate_up, *act;
    ShmGroup* tp;  // tensor parallel: this rank's group, whose sum each row-parallel GEMM's output is; or NULL
    // Attention beyond causal (decode_attention's): each layer's sliding window (0: none; NULL: no
    // layer has one) and the scores' soft-cap (0: none).
    const int64_t* windows;
    float softcap;
    int64_t gelu;  // the MLP's gate: gelu_tanh (Gemma's GeGLU), or 0: silu
} DecodeStep;

static int gemm(const LayerGemm* w, const float* x, float* y, int64_t T) {
    if (w->panels && T > w->blocks_max_rows)
        return relay_gemm_bf16_panels(x, w->k, 1, w->panels, NULL, y, w->n, 1, T, w->n, w->k);
    return relay_gemm_blocks((int)w->bits, w->q, w->d, w->m, x, w->k, y, w->n, T, w->n, w->k, (int)w->round_bf16);
}

// Returns 1, or 0 if a GEMM refused its shape or a tensor-parallel all-reduce failed (nothing is
// then usable).
int relay_decode_layers(const DecodeLayer* layers, int64_t num_layers, const DecodeStep* s) {
    const int64_t T = s->T, H = s->hidden, qkv_n = (s->nq + 2 * s->nk) * s->D;
    float* h = s->out;  // the normed input of the next GEMM; also each layer's MLP output
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer* L = layers + l;
        if (l == 0) relay_rms_norm(s->x, NULL, L->input_norm, h, T, H, s->eps, 0);
        else relay_rms_norm(h, s->x, L->input_norm, h, T, H, s->eps, 0);
        if (!gemm(&L->qkv, h, s->qkv, T)) return 0;
        if (L->q_norm) relay_head_norm(s->qkv, L->q_norm, L->k_norm, T, qkv_n, s->nq, s->nk, s->D, s->eps, 0);
        relay_rope(s->qkv, L->cos, L->sin, s->positions, T, qkv_n, s->nq, s->nk, s->D, 0);
        decode_attention(s->qkv, qkv_n, s->qkv + s->nq * s->D, qkv_n, s->qkv + (s->nq + s->nk) * s->D, qkv_n,
                         L->k_cache, L->v_cache, s->tables, s->lens, s->order, s->attn, T, s->nq, s->nk, s->D, s->S,
                         s->P, s->PS, s->chunk, s->scale, 0, (int)s->kv_bf16, s->windows ? s->windows[l] : 0,
                         s->softcap, s->n_groups, s->group_first, s->group_size, s->group_keys, NULL);
        if (!gemm(&L->o, s->attn, h, T)) return 0;
        if (s->tp && relay_shm_all_reduce(s->tp, h, T * H, 0) != 1) return 0;
        if (L->pre_mlp_norm) {  // Gemma: the attention's output normed, then added and normed again
            relay_rms_norm(h, NULL, L->post_norm, h, T, H, s->eps, 0);
            relay_rms_norm(h, s->x, L->pre_mlp_norm, h, T, H, s->eps, 0);
        } else relay_rms_norm(h, s->x, L->post_norm, h, T, H, s->eps, 0);
        if (!gemm(&L->gate_up, h, s->gate_up, T)) return 0;
        if (s->gelu) relay_gelu_tanh_mul(s->gate_up, s->act, T, s->inter, 0);
        else relay_silu_mul(s->gate_up, s->act, T, s->inter, 0);
        if (!gemm(&L->down, s->act, h, T)) return 0;
        if (s->tp && relay_shm_all_reduce(s->tp, h, T * H, 0) != 1) return 0;
        if (L->post_mlp_norm) relay_rms_norm(h, NULL, L->post_mlp_norm, h, T, H, s->eps, 0);
    }
    relay_rms_norm(h, s->x, s->final_norm, h, T, H, s->eps, 0);
    return 1;
}

// ---- steps with prompt chunks ------------------------------------------------------------------
// A step that prefills prompt chunks (with any decodes beside them) of a bfloat16 model whose GEMM
// weights are all Bf16Panels, in one call: the kernels the Python layers call for such a step, in
// their order, on bfloat16 activations, so the output is theirs bit for bit. It removes the
// interpreter between ~12 kernel calls per layer (~8-14 ms of a 256-token chunk's ~170 ms on a
// 2-core Zen 4) and the KV write's torch indexing.
int extend_attention(const void* q, int64_t q_stride, const void* k, const void* v, const int32_t* tables,
                     int64_t P, const int64_t* q_starts, const int64_t* prefix_lens, const int64_t* extend_lens,
                     int64_t R, void* out, int64_t H, int64_t HKV, int64_t D, int64_t S, int64_t PS, float scale,
                     int io_bf16, int kv_bf16, int64_t window, float softcap, const float* sinks);

typedef struct {  // one decoder layer: bfloat16 norms and panels ([N, K] weights), bfloat16 caches
    const uint16_t* input_norm;
    const uint16_t* post_norm;
    const uint32_t *qkv, *o, *gate_up, *down;
    uint16_t* k_cache;  // [HKV, S, D]
    uint16_t* v_cache;
} PromptLayer;

typedef struct {
    int64_t T, hidden, inter, nq, nk, D;
    float eps, scale;
    const float* cos;  // RotaryEmbedding tables, [positions, D]
    const float* sin;
    const int64_t* positions;  // [T]
    const int64_t* out_slots;  // [T]: where each row's keys and values go
    int64_t S, PS;
    // rows of one new token (decodes): which rows, and decode_attention's plan for them
    int64_t n_dec;
    const int64_t* dec_rows;
    const int32_t* dec_tables;
    const int64_t* dec_lens;
    const int64_t* dec_order;
    int64_t dec_P, chunk, n_groups;
    const int64_t* group_first;
    const int64_t* group_size;
    const int64_t* group_keys;
    // prompt chunks: extend_attention's plan
    int64_t R, ext_P;
    const int32_t* ext_tables;
    const int64_t* q_starts;
    const int64_t* prefix_lens;
    const int64_t* extend_lens;
    const uint16_t* final_norm;
    // bfloat16: x [T, hidden] the embeddings in, then the residual stream; out [T, hidden] the final
    // norm's output; scratch qkv [T, qkv_n], attn [T, nq * D], gate_up [T, 2 * inter], act [T, inter],
    // dec_q and dec_out [n_dec, nq * D]
    uint16_t *x, *out, *qkv, *attn, *gate_up, *act, *dec_q, *dec_out;
    // the rows whose output is read (increasing), or n_keep < 0: all. The last layer runs past its
    // attention for those only, and out holds them in its first n_keep rows.
    int64_t n_keep;
    const int64_t* keep_rows;
    ShmGroup* tp;  // as DecodeStep's
    const int64_t* windows;  // as DecodeStep's
    float softcap;
} PromptStep;

static int gemm_panels_bf16(const uint32_t* panels, const uint16_t* x, uint16_t* y, int64_t T, int64_t N, int64_t K) {
    return relay_gemm_bf16_panels(x, K, 0, panels, NULL, y, N, 0, T, N, K);
}

// Each row's new keys and values into the cache at its slot (what the layers' index_copy_ does).
static void write_kv(const PromptStep* s, const PromptLayer* L) {
    const int64_t qkv_n = (s->nq + 2 * s->nk) * s->D, D = s->D;
    _Pragma("omp parallel for schedule(static) if (s->T > 16)")
    for (int64_t t = 0; t < s->T; t++)
        for (int64_t h = 0; h < s->nk; h++) {
            const uint16_t* row = s->qkv + t * qkv_n;
            const int64_t dst = (h * s->S + s->out_slots[t]) * D;
            memcpy(L->k_cache + dst, row + (s->nq + h) * D, sizeof(uint16_t) * (size_t)D);
            memcpy(L->v_cache + dst, row + (s->nq + s->nk + h) * D, sizeof(uint16_t) * (size_t)D);
        }
}

static void attend(const PromptStep* s, const PromptLayer* L, int64_t window) {
    const int64_t qkv_n = (s->nq + 2 * s->nk) * s->D, width = s->nq * s->D;
    write_kv(s, L);
    if (s->n_dec) {  // gathered, attended, scattered back, as the layers do
        for (int64_t i = 0; i < s->n_dec; i++)
            memcpy(s->dec_q + i * width, s->qkv + s->dec_rows[i] * qkv_n, sizeof(uint16_t) * (size_t)width);
        decode_attention(s->dec_q, width, NULL, 0, NULL, 0, L->k_cache, L->v_cache, s->dec_tables, s->dec_lens,
                         s->dec_order, s->dec_out, s->n_dec, s->nq, s->nk, s->D, s->S, s->dec_P, s->PS, s->chunk,
                         s->scale, 1, 1, window, s->softcap, s->n_groups, s->group_first, s->group_size,
                         s->group_keys, NULL);
        for (int64_t i = 0; i < s->n_dec; i++)
            memcpy(s->attn + s->dec_rows[i] * width, s->dec_out + i * width, sizeof(uint16_t) * (size_t)width);
    }
    if (s->R)
        extend_attention(s->qkv, qkv_n, L->k_cache, L->v_cache, s->ext_tables, s->ext_P, s->q_starts, s->prefix_lens,
                         s->extend_lens, s->R, s->attn, s->nq, s->nk, s->D, s->S, s->PS, s->scale, 1, 1, window,
                         s->softcap, NULL);
}

// Rows keep[i] of a [*, width] bfloat16 matrix moved up to rows i (keep increasing: in place).
static void compact_rows(uint16_t* a, int64_t width, const int64_t* keep, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (keep[i] != i) memcpy(a + i * width, a + keep[i] * width, sizeof(uint16_t) * (size_t)width);
}

// Returns 1, or 0 as relay_decode_layers.
int relay_prompt_layers(const PromptLayer* layers, int64_t num_layers, const PromptStep* s) {
    const int64_t H = s->hidden, qkv_n = (s->nq + 2 * s->nk) * s->D;
    int64_t T = s->T;
    uint16_t* h = s->out;  // the normed input of the next GEMM; also each layer's MLP output
    for (int64_t l = 0; l < num_layers; l++) {
        const PromptLayer* L = layers + l;
        if (l == 0) relay_rms_norm(s->x, NULL, L->input_norm, h, T, H, s->eps, 1);
        else relay_rms_norm(h, s->x, L->input_norm, h, T, H, s->eps, 1);
        if (!gemm_panels_bf16(L->qkv, h, s->qkv, T, qkv_n, H)) return 0;
        relay_rope(s->qkv, s->cos, s->sin, s->positions, T, qkv_n, s->nq, s->nk, s->D, 1);
        attend(s, L, s->windows ? s->windows[l] : 0);
        if (l == num_layers - 1 && s->n_keep >= 0 && s->n_keep < T) {  // the other rows are done
            T = s->n_keep;
            if (!T) return 1;
            compact_rows(s->attn, s->nq * s->D, s->keep_rows, T);
            compact_rows(s->x, H, s->keep_rows, T);
        }
        if (!gemm_panels_bf16(L->o, s->attn, h, T, H, s->nq * s->D)) return 0;
        if (s->tp && relay_shm_all_reduce(s->tp, h, T * H, 1) != 1) return 0;
        relay_rms_norm(h, s->x, L->post_norm, h, T, H, s->eps, 1);
        if (!gemm_panels_bf16(L->gate_up, h, s->gate_up, T, 2 * s->inter, H)) return 0;
        relay_silu_mul(s->gate_up, s->act, T, s->inter, 1);
        if (!gemm_panels_bf16(L->down, s->act, h, T, H, s->inter)) return 0;
        if (s->tp && relay_shm_all_reduce(s->tp, h, T * H, 1) != 1) return 0;
    }
    relay_rms_norm(h, s->x, s->final_norm, h, T, H, s->eps, 1);
    return 1;
}
