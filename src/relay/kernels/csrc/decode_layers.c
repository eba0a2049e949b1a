// A whole decode step's decoder layers in one call, for models whose GEMM weights are all GGUF
// blocks (relay/weight_blocks.py), in float32 activations: the same kernels, in the same order, on
// the same buffers as the Python layers of a float32 model call them one by one, so where those
// read the blocks too the output is bit for bit theirs (a bfloat16 model's layers keep bfloat16
// activations between kernels, this call float32 ones: close, not equal). What
// it removes is the interpreter between them: ~8 kernel calls per layer through torch modules
// and ctypes cost ~5 ms of a ~17 ms batch-1 step on a 2-core Xeon, while the other core waits.
#include <stddef.h>
#include <stdint.h>

int relay_gemm_blocks(int bits, const uint8_t* q, const float* d, const float* m, const float* x, int64_t x_stride,
                      float* y, int64_t y_stride, int64_t M, int64_t N, int64_t K, int round_bf16);
int relay_gemm_bf16_panels(const void* x, int64_t x_stride, int x_f32, const uint32_t* panels, const uint16_t* bias,
                           void* y, int64_t y_stride, int y_f32, int64_t M, int64_t N, int64_t K);
void relay_rms_norm(const void* x, void* residual, const void* w, void* out, int64_t T, int64_t H, float eps,
                    int bf16);
void relay_rope(void* qkv, const float* cos, const float* sin, const int64_t* positions, int64_t T, int64_t stride,
                int64_t nq, int64_t nk, int64_t D, int bf16);
void relay_silu_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16);
void decode_attention(const void* q, int64_t q_stride, const void* new_k, int64_t k_stride, const void* new_v,
                      int64_t v_stride, void* k, void* v, const int32_t* tables, const int64_t* lens,
                      const int64_t* order, void* out, int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t S,
                      int64_t P, int64_t PS, int64_t chunk, float scale, int io_bf16, int kv_bf16,
                      int64_t n_groups, const int64_t* group_first, const int64_t* group_size,
                      const int64_t* group_keys);

typedef struct {  // a [n, k] weight in blocks (BlockWeight) and maybe bfloat16 panels (cpu.LayerGemm)
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
    const float* post_norm;
    LayerGemm qkv, o, gate_up, down;
    void* k_cache;  // [HKV, S, D]
    void* v_cache;
} DecodeLayer;

typedef struct {  // one step: T requests, one new token each
    int64_t T, hidden, inter, nq, nk, D;
    float eps, scale;
    const float* cos;  // RotaryEmbedding tables, [positions, D]
    const float* sin;
    const int64_t* positions;  // [T]
    // decode_attention's plan (cpu.DecodePlan) and cache geometry
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
} DecodeStep;

static int gemm(const LayerGemm* w, const float* x, float* y, int64_t T) {
    if (w->panels && T > w->blocks_max_rows)
        return relay_gemm_bf16_panels(x, w->k, 1, w->panels, NULL, y, w->n, 1, T, w->n, w->k);
    return relay_gemm_blocks((int)w->bits, w->q, w->d, w->m, x, w->k, y, w->n, T, w->n, w->k, (int)w->round_bf16);
}

// Returns 1, or 0 if a GEMM refused its shape (nothing is then usable).
int relay_decode_layers(const DecodeLayer* layers, int64_t num_layers, const DecodeStep* s) {
    const int64_t T = s->T, H = s->hidden, qkv_n = (s->nq + 2 * s->nk) * s->D;
    float* h = s->out;  // the normed input of the next GEMM; also each layer's MLP output
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer* L = layers + l;
        if (l == 0) relay_rms_norm(s->x, NULL, L->input_norm, h, T, H, s->eps, 0);
        else relay_rms_norm(h, s->x, L->input_norm, h, T, H, s->eps, 0);
        if (!gemm(&L->qkv, h, s->qkv, T)) return 0;
        relay_rope(s->qkv, s->cos, s->sin, s->positions, T, qkv_n, s->nq, s->nk, s->D, 0);
        decode_attention(s->qkv, qkv_n, s->qkv + s->nq * s->D, qkv_n, s->qkv + (s->nq + s->nk) * s->D, qkv_n,
                         L->k_cache, L->v_cache, s->tables, s->lens, s->order, s->attn, T, s->nq, s->nk, s->D, s->S,
                         s->P, s->PS, s->chunk, s->scale, 0, (int)s->kv_bf16, s->n_groups, s->group_first,
                         s->group_size, s->group_keys);
        if (!gemm(&L->o, s->attn, h, T)) return 0;
        relay_rms_norm(h, s->x, L->post_norm, h, T, H, s->eps, 0);
        if (!gemm(&L->gate_up, h, s->gate_up, T)) return 0;
        relay_silu_mul(s->gate_up, s->act, T, s->inter, 0);
        if (!gemm(&L->down, s->act, h, T)) return 0;
    }
    relay_rms_norm(h, s->x, s->final_norm, h, T, H, s->eps, 0);
    return 1;
}
