// Collectives among the tensor-parallel ranks of one machine, through a shared memory segment.
//
// gloo over loopback took ~0.3-0.4 ms a call with 4-5 ms tails (../shared/FACTS.md): 60 all-reduces
// a step made a 4 ms batch-1 decode step ~80 ms with --tp 2 on a 2-core machine. Here a collective
// is a copy into this rank's slot, an arrival counter, and a wait for the others' counters (a few
// microseconds when they are there), and every rank then reads all slots.
//
// Segment: `size` arrival counters, then two banks of `size` byte counts (a cache line each), then
// two banks of `size` slots of slot_bytes. Collective number gen uses bank gen % 2: a rank can
// start collective gen + 1 (and write the other bank) while a slower one still reads bank gen % 2,
// and cannot start gen + 2 before every rank has arrived at gen + 1, i.e. finished reading gen.
// Reductions add the slots in rank order on every rank, so every rank gets the same bits. Each
// rank also posts its byte count: ranks whose calls differ (a bug that would otherwise sum one
// rank's floats with another's bfloat16) fail loudly instead.
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "simd.h"

#define LINE 64  // one counter or byte count per cache line: ranks write their own only

typedef struct ShmGroup {  // this rank's view of the group (distributed.ShmGroup keeps it)
    char* base;  // the mapped segment
    int64_t rank, size, slot_bytes;
    uint64_t gen;  // collectives this rank has started
    double timeout_s;  // a rank that waits longer gives up: another rank died or hangs
    int64_t spins;  // pauses before a waiting rank yields its core (few where ranks outnumber cores)
} ShmGroup;

#define RELAY_SHM_OK 1
#define RELAY_SHM_TIMEOUT 0
#define RELAY_SHM_MISMATCH (-1)

int64_t relay_shm_segment_bytes(int64_t size, int64_t slot_bytes) {
    return 3 * size * LINE + 2 * size * slot_bytes;
}

static uint64_t* counter(const ShmGroup* g, int64_t r) { return (uint64_t*)(g->base + r * LINE); }

static int64_t* byte_count(const ShmGroup* g, uint64_t gen, int64_t r) {
    return (int64_t*)(g->base + (g->size + (int64_t)(gen & 1) * g->size + r) * LINE);
}

static char* slot(const ShmGroup* g, uint64_t gen, int64_t r) {
    return g->base + 3 * g->size * LINE + ((int64_t)(gen & 1) * g->size + r) * g->slot_bytes;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// Spins, then yields the core to whatever else wants it (the server's other processes share the
// cores), until every rank has arrived at collective gen; 0 past the timeout.
static int wait_all(const ShmGroup* g, uint64_t gen) {
    double start = 0.;
    for (int64_t r = 0; r < g->size; r++)
        for (uint64_t spins = 0; __atomic_load_n(counter(g, r), __ATOMIC_ACQUIRE) < gen; spins++) {
            if (spins < (uint64_t)g->spins) { CPU_RELAX(); continue; }
            sched_yield();
            if (spins % 1024 == 0) {
                if (start == 0.) start = now_s();
                else if (now_s() - start > g->timeout_s) return 0;
            }
        }
    return 1;
}

// This rank's nbytes (<= slot_bytes) into its slot of collective gen (the next one), then
// every rank's: RELAY_SHM_OK, or RELAY_SHM_TIMEOUT, or RELAY_SHM_MISMATCH where a rank posted
// another byte count.
static int exchange(ShmGroup* g, uint64_t gen, const void* src, int64_t nbytes) {
    memcpy(slot(g, gen, g->rank), src, (size_t)nbytes);
    *byte_count(g, gen, g->rank) = nbytes;
    __atomic_store_n(counter(g, g->rank), gen, __ATOMIC_RELEASE);
    if (!wait_all(g, gen)) return RELAY_SHM_TIMEOUT;
    for (int64_t r = 0; r < g->size; r++)
        if (*byte_count(g, gen, r) != nbytes) return RELAY_SHM_MISMATCH;
    return RELAY_SHM_OK;
}

// The sum over the ranks of `len` values of each slot of collective gen, into out: float32 additions
// in rank order, a bfloat16 sum rounded once.
static void sum_slots(const ShmGroup* g, uint64_t gen, int64_t len, void* out, int bf16) {
    if (bf16) {
        for (int64_t i = 0; i < len; i++) {
            float sum = 0.f;
            for (int64_t r = 0; r < g->size; r++) sum += bf16_to_f32(((const uint16_t*)slot(g, gen, r))[i]);
            ((uint16_t*)out)[i] = f32_to_bf16(sum);
        }
        return;
    }
    float* o = (float*)out;
    memcpy(o, slot(g, gen, 0), sizeof(float) * (size_t)len);
    for (int64_t r = 1; r < g->size; r++) {
        const float* src = (const float*)slot(g, gen, r);
        for (int64_t i = 0; i < len; i++) o[i] += src[i];
    }
}

// data [n] float32 (bf16 = 0) or bfloat16 (bf16 = 1), in place: the sum over the ranks. Returns
// exchange's verdict.
int relay_shm_all_reduce(ShmGroup* g, void* data, int64_t n, int bf16) {
    const int64_t esz = bf16 ? 2 : 4, per = g->slot_bytes / esz;
    for (int64_t off = 0; off < n; off += per) {
        const int64_t len = n - off < per ? n - off : per;
        char* mine = (char*)data + off * esz;
        const uint64_t gen = ++g->gen;
        const int verdict = exchange(g, gen, mine, len * esz);
        if (verdict != RELAY_SHM_OK) return verdict;
        sum_slots(g, gen, len, mine, bf16);
    }
    return RELAY_SHM_OK;
}

// Every rank's nbytes at src (the same count on every rank) into dst [size, nbytes], in rank
// order. Returns exchange's verdict.
int relay_shm_all_gather(ShmGroup* g, const void* src, int64_t nbytes, void* dst) {
    for (int64_t off = 0; off < nbytes; off += g->slot_bytes) {
        const int64_t len = nbytes - off < g->slot_bytes ? nbytes - off : g->slot_bytes;
        const uint64_t gen = ++g->gen;
        const int verdict = exchange(g, gen, (const char*)src + off, len);
        if (verdict != RELAY_SHM_OK) return verdict;
        for (int64_t r = 0; r < g->size; r++)
            memcpy((char*)dst + r * nbytes + off, slot(g, gen, r), (size_t)len);
    }
    return RELAY_SHM_OK;
}
