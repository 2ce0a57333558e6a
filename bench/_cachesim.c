/* Offline cache simulators for bench/traffic.py: exact LRU, S3-FIFO as the store runs it, Belady.
 *
 * Plain C, no Python headers: traffic.py builds this with `cc -O2 -shared -fPIC` on first use and
 * calls it through ctypes with numpy arrays.
 *
 * A trace is `ids` (int32, n accesses) of dense ids 0..n_ids-1 (rows compacted with np.unique), cut
 * into lookups by `bounds` (int64, n_lookups + 1) where a policy works per lookup. Each function
 * returns the hits among accesses i >= count_from, or -1 if it could not allocate its state.
 */

#include <stdint.h>
#include <stdlib.h>

/* nxt[i] = the next j > i with ids[j] == ids[i]; n + i when there is none (distinct, farther than any use). */
int cs_next_use(const int32_t *ids, int64_t n, int64_t n_ids, int64_t *nxt)
{
    int64_t *last = malloc((size_t)(n_ids ? n_ids : 1) * sizeof *last);
    if (!last)
        return -1;
    for (int64_t k = 0; k < n_ids; k++)
        last[k] = -1;
    for (int64_t i = n - 1; i >= 0; i--) {
        int32_t id = ids[i];
        nxt[i] = last[id] < 0 ? n + i : last[id];
        last[id] = i;
    }
    free(last);
    return 0;
}

/* Exact per-access LRU of `capacity` entries: a doubly linked list over dense ids, O(1) per access. */
int64_t cs_lru(const int32_t *ids, int64_t n, int64_t n_ids, int64_t capacity, int64_t count_from)
{
    int32_t *prev = malloc((size_t)n_ids * sizeof *prev), *next = malloc((size_t)n_ids * sizeof *next);
    uint8_t *in = calloc((size_t)n_ids, 1);
    if (!prev || !next || !in) {
        free(prev), free(next), free(in);
        return -1;
    }
    int32_t head = -1, tail = -1; /* head: most recent */
    int64_t size = 0, hits = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (in[id]) {
            hits += i >= count_from;
            if (id == head)
                continue;
            next[prev[id]] = next[id]; /* unlink (id is not the head, so it has a prev) */
            if (next[id] >= 0)
                prev[next[id]] = prev[id];
            else
                tail = prev[id];
        } else {
            if (size == capacity) { /* drop the least recent */
                int32_t old = tail;
                in[old] = 0;
                tail = prev[old];
                if (tail >= 0)
                    next[tail] = -1;
                else
                    head = -1;
            } else {
                size++;
            }
            in[id] = 1;
        }
        prev[id] = -1; /* push at the head */
        next[id] = head;
        if (head >= 0)
            prev[head] = id;
        head = id;
        if (tail < 0)
            tail = id;
    }
    free(prev), free(next), free(in);
    return hits;
}

/* Belady's MIN with bypass: on a miss with the cache full, evict the cached entry used farthest ahead,
 * unless the new one is used even later (then it is not admitted). `nxt` from cs_next_use. An indexed
 * binary max-heap on next use; an entry's next use only grows, so a hit sifts it up. */
typedef struct {
    int64_t *key;
    int32_t *id;
    int32_t *pos; /* heap position of a dense id, -1: not cached */
    int64_t size;
} heap_t;

static void heap_set(heap_t *h, int64_t at, int64_t key, int32_t id)
{
    h->key[at] = key;
    h->id[at] = id;
    h->pos[id] = (int32_t)at;
}

static void heap_up(heap_t *h, int64_t at)
{
    int64_t key = h->key[at];
    int32_t id = h->id[at];
    while (at > 0) {
        int64_t parent = (at - 1) / 2;
        if (h->key[parent] >= key)
            break;
        heap_set(h, at, h->key[parent], h->id[parent]);
        at = parent;
    }
    heap_set(h, at, key, id);
}

static void heap_down(heap_t *h, int64_t at)
{
    int64_t key = h->key[at];
    int32_t id = h->id[at];
    for (;;) {
        int64_t child = 2 * at + 1;
        if (child >= h->size)
            break;
        if (child + 1 < h->size && h->key[child + 1] > h->key[child])
            child++;
        if (h->key[child] <= key)
            break;
        heap_set(h, at, h->key[child], h->id[child]);
        at = child;
    }
    heap_set(h, at, key, id);
}

int64_t cs_belady(const int32_t *ids, const int64_t *nxt, int64_t n, int64_t n_ids, int64_t capacity,
                  int64_t count_from)
{
    heap_t h = {malloc((size_t)capacity * sizeof(int64_t)), malloc((size_t)capacity * sizeof(int32_t)),
                malloc((size_t)n_ids * sizeof(int32_t)), 0};
    if (!h.key || !h.id || !h.pos) {
        free(h.key), free(h.id), free(h.pos);
        return -1;
    }
    for (int64_t k = 0; k < n_ids; k++)
        h.pos[k] = -1;
    int64_t hits = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        int64_t nu = nxt[i];
        if (h.pos[id] >= 0) {
            hits += i >= count_from;
            h.key[h.pos[id]] = nu; /* grows: sift up */
            heap_up(&h, h.pos[id]);
        } else if (h.size < capacity) {
            heap_set(&h, h.size, nu, id);
            heap_up(&h, h.size++);
        } else if (h.key[0] > nu) { /* evict the farthest, take its place */
            h.pos[h.id[0]] = -1;
            heap_set(&h, 0, nu, id);
            heap_down(&h, 0);
        } /* else bypass */
    }
    free(h.key), free(h.id), free(h.pos);
    return hits;
}

/* S3-FIFO exactly as engram_store/storage/policies/s3fifo.py runs inside the store's RowCache
 * (storage/arena.py), one lookup at a time:
 *   1. every hit of the lookup: freq = min(freq, freq_max - 1) + 1 (RowCache.begin -> on_hit);
 *   2. the misses, in trace order, capped at admit_limit (evenly spaced, as np.linspace picks them);
 *   3. if they outnumber the free slots, evict() the difference in rounds: a round takes the small
 *      FIFO (if it holds >= small_target entries, or main is empty) else the main CLOCK, looks at a
 *      window of max(4 * need, min_window) entries from its head and consumes them until `need`
 *      cold (freq 0) entries are gone: from small, warm ones move to main (freq 0), cold ones leave
 *      into the ghost; from main, warm ones go back to its tail with freq - 1, cold ones leave;
 *      after max_rounds rounds, main entries leave whatever their freq;
 *   4. insert: freq 0; a miss whose key the ghost holds goes to main, the others to small.
 * The ghost is the policy's direct-mapped table of 32-bit fingerprints of the store keys `keys[id]`
 * (layer index << 40 | row), 2^ghost_bits entries, same hash. Policy state is kept per dense id
 * instead of per slot: a slot's identity never changes a decision.
 * `stats` (S3_STATS int64s, or NULL) receives the counters below, for the report. */
enum { S3_SMALL_EVICTED, S3_PROMOTED, S3_MAIN_EVICTED, S3_GHOST_ADMITTED, S3_SMALL_AT_END, S3_STATS };

typedef struct {
    int32_t *buf;
    int64_t cap, head, count;
} ring_t;

static int32_t ring_pop(ring_t *r)
{
    int32_t v = r->buf[r->head];
    r->head = r->head + 1 == r->cap ? 0 : r->head + 1;
    r->count--;
    return v;
}

static void ring_push(ring_t *r, int32_t v)
{
    int64_t at = r->head + r->count;
    r->buf[at >= r->cap ? at - r->cap : at] = v;
    r->count++;
}

typedef struct {
    uint32_t *fp;
    int bits;
} ghost_t;

static void ghost_hash(const ghost_t *g, int64_t key, uint64_t *index, uint32_t *fingerprint)
{
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ULL;
    *index = h >> (64 - g->bits);
    *fingerprint = (uint32_t)(h & 0xFFFFFFFFULL) | 1u;
}

typedef struct {
    uint8_t *freq, *cached;
    ring_t small, main;
    ghost_t ghost;
    const int64_t *keys;
    int64_t small_target, min_window, max_rounds;
    int freq_max;
    int64_t used;
    int64_t stats[S3_STATS];
} s3_t;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static void s3_evict(s3_t *s, int64_t need)
{
    int64_t rounds = 0;
    while (need > 0 && s->small.count + s->main.count) {
        rounds++;
        int force = rounds > s->max_rounds;
        if (s->small.count && (s->small.count >= s->small_target || !s->main.count)) {
            int64_t window = min64(s->small.count, max64(4 * need, s->min_window));
            for (int64_t w = 0; w < window && need > 0; w++) {
                int32_t id = ring_pop(&s->small);
                if (s->freq[id]) {
                    s->freq[id] = 0;
                    ring_push(&s->main, id);
                    s->stats[S3_PROMOTED]++;
                } else {
                    uint64_t index;
                    uint32_t fingerprint;
                    ghost_hash(&s->ghost, s->keys[id], &index, &fingerprint);
                    s->ghost.fp[index] = fingerprint;
                    s->cached[id] = 0;
                    s->used--;
                    need--;
                    s->stats[S3_SMALL_EVICTED]++;
                }
            }
        } else {
            int64_t window = min64(s->main.count, max64(4 * need, s->min_window));
            for (int64_t w = 0; w < window && need > 0; w++) { /* kept entries land behind the window */
                int32_t id = ring_pop(&s->main);
                if (force || !s->freq[id]) {
                    s->cached[id] = 0;
                    s->used--;
                    need--;
                    s->stats[S3_MAIN_EVICTED]++;
                } else {
                    s->freq[id]--;
                    ring_push(&s->main, id);
                }
            }
        }
    }
}

int64_t cs_s3fifo(const int32_t *ids, const int64_t *bounds, int64_t n_lookups, int64_t n_ids, const int64_t *keys,
                  int64_t n_slots, int64_t small_target, int ghost_bits, int freq_max, int64_t min_window,
                  int64_t max_rounds, int64_t admit_limit, int64_t count_from, int64_t *stats)
{
    s3_t s = {calloc((size_t)n_ids, 1), calloc((size_t)n_ids, 1),
              {malloc((size_t)n_slots * sizeof(int32_t)), n_slots, 0, 0},
              {malloc((size_t)n_slots * sizeof(int32_t)), n_slots, 0, 0},
              {calloc((size_t)1 << ghost_bits, sizeof(uint32_t)), ghost_bits},
              keys, small_target, min_window, max_rounds, freq_max, 0, {0}};
    int64_t max_lookup = 0;
    for (int64_t b = 0; b < n_lookups; b++)
        max_lookup = max64(max_lookup, bounds[b + 1] - bounds[b]);
    int32_t *miss = malloc((size_t)(max_lookup ? max_lookup : 1) * sizeof *miss);
    int64_t hits = 0;
    if (!s.freq || !s.cached || !s.small.buf || !s.main.buf || !s.ghost.fp || !miss) {
        hits = -1;
        goto out;
    }
    for (int64_t b = 0; b < n_lookups; b++) {
        int64_t n_miss = 0;
        for (int64_t i = bounds[b]; i < bounds[b + 1]; i++) {
            int32_t id = ids[i];
            if (s.cached[id]) {
                hits += i >= count_from;
                s.freq[id] = (uint8_t)(min64(s.freq[id], freq_max - 1) + 1);
            } else {
                miss[n_miss++] = id;
            }
        }
        if (n_miss > admit_limit) { /* np.linspace(0, n_miss - 1, admit_limit).astype(intp) */
            double step = admit_limit > 1 ? (double)(n_miss - 1) / (double)(admit_limit - 1) : 0.0;
            for (int64_t k = 0; k < admit_limit; k++)
                miss[k] = miss[k + 1 == admit_limit && admit_limit > 1 ? n_miss - 1 : (int64_t)((double)k * step)];
            n_miss = admit_limit;
        }
        if (n_miss > n_slots - s.used)
            s3_evict(&s, n_miss - (n_slots - s.used));
        n_miss = min64(n_miss, n_slots - s.used);
        for (int64_t k = 0; k < n_miss; k++) {
            int32_t id = miss[k];
            uint64_t index;
            uint32_t fingerprint;
            ghost_hash(&s.ghost, keys[id], &index, &fingerprint);
            s.freq[id] = 0;
            s.cached[id] = 1;
            int ghost = s.ghost.fp[index] == fingerprint;
            ring_push(ghost ? &s.main : &s.small, id);
            s.stats[S3_GHOST_ADMITTED] += ghost;
        }
        s.used += n_miss;
    }
    s.stats[S3_SMALL_AT_END] = s.small.count;
    if (stats)
        for (int k = 0; k < S3_STATS; k++)
            stats[k] = s.stats[k];
out:
    free(s.freq), free(s.cached), free(s.small.buf), free(s.main.buf), free(s.ghost.fp), free(miss);
    return hits;
}
