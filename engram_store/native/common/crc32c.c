/* crc32c (Castagnoli): the implementation behind crc32c.h.
 *
 * The hardware path runs on x86-64 with SSE4.2 (crc32q) and on aarch64 with the ARMv8 CRC32
 * extension (crc32cx; getauxval(AT_HWCAP) & HWCAP_CRC32, present on every Grace / Neoverse
 * core). Both are probed at run time and compiled with a per-function target attribute, so a
 * generic x86-64 or armv8-a build still loads on a CPU without them. Pages go four at a time,
 * four independent crc chains hiding the instruction's latency; a page left over (the common
 * case of a one-page read) is cut into four 1 KiB chains instead, joined by advancing each
 * partial register over the 1 KiB that follows it (a linear map on 32 bits: four 256-entry
 * tables). Without the instruction (or hw=0, for tests) slicing-by-8 tables; every path gives
 * the same value.
 */
#include "crc32c.h"

#include <string.h>

#define CRC32C_POLY 0x82F63B78u  /* Castagnoli, reflected */
#define CRC_CHUNK (PAGE / 4)     /* a page's four chains */

static uint32_t crc_table[8][256];
static uint32_t crc_skip[4][256];  /* crc_skip_chunk(x) by bytes of x: x advanced over CRC_CHUNK zero bytes */
static int crc_hw = 0;             /* the CPU's crc32c instruction is available (HAVE_CRC_HW) */

/* The one instruction the hardware path needs, per architecture: crc_hw_word (8 bytes) and
   crc_hw_byte on the raw register (crc_reg_t: the instruction's own register width, so a chain
   needs no zero-extension between steps), compiled for CRC_HW_TARGET only; crc_hw_probe says
   whether this CPU has it. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_CRC_HW 1
#define CRC_HW_NAME "sse4.2"
#define CRC_HW_TARGET __attribute__((target("sse4.2")))
typedef uint64_t crc_reg_t;
CRC_HW_TARGET static inline crc_reg_t crc_hw_word(crc_reg_t c, uint64_t w) { return __builtin_ia32_crc32di(c, w); }
CRC_HW_TARGET static inline uint32_t crc_hw_byte(uint32_t c, uint8_t b) { return __builtin_ia32_crc32qi(c, b); }
static int crc_hw_probe(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include <arm_acle.h>
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)  /* linux/arch/arm64/include/uapi/asm/hwcap.h */
#endif
#define HAVE_CRC_HW 1
#define CRC_HW_NAME "armv8-crc32"
#if defined(__clang__)
#define CRC_HW_TARGET __attribute__((target("crc")))
#else
#define CRC_HW_TARGET __attribute__((target("+crc")))
#endif
typedef uint32_t crc_reg_t;
CRC_HW_TARGET static inline crc_reg_t crc_hw_word(crc_reg_t c, uint64_t w) { return __crc32cd(c, w); }
CRC_HW_TARGET static inline uint32_t crc_hw_byte(uint32_t c, uint8_t b) { return __crc32cb(c, b); }
static int crc_hw_probe(void) { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#endif

/* Raw (not inverted) crc register over n bytes, slicing by 8. */
static uint32_t crc_sw(uint32_t c, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^ crc_table[5][(w >> 16) & 0xFF] ^
            crc_table[4][(w >> 24) & 0xFF] ^ crc_table[3][(w >> 32) & 0xFF] ^ crc_table[2][(w >> 40) & 0xFF] ^
            crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF];
    return c;
}

void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
    /* Advancing the register over zeros is linear: tabulate it from its value on each bit. */
    static const uint8_t zeros[CRC_CHUNK];
    uint32_t bit[32];
    for (int b = 0; b < 32; b++) bit[b] = crc_sw((uint32_t)1 << b, zeros, CRC_CHUNK);
    for (int j = 0; j < 4; j++)
        for (uint32_t v = 0; v < 256; v++) {
            uint32_t x = 0;
            for (int b = 0; b < 8; b++)
                if (v >> b & 1) x ^= bit[8 * j + b];
            crc_skip[j][v] = x;
        }
#ifdef HAVE_CRC_HW
    crc_hw = crc_hw_probe();
#endif
}

static uint32_t crc_skip_chunk(uint32_t x) {
    return crc_skip[0][x & 0xFF] ^ crc_skip[1][(x >> 8) & 0xFF] ^ crc_skip[2][(x >> 16) & 0xFF] ^ crc_skip[3][x >> 24];
}

#ifdef HAVE_CRC_HW
CRC_HW_TARGET static uint32_t crc_hw_run(uint32_t c, const uint8_t *p, size_t n) {
    crc_reg_t r = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        r = crc_hw_word(r, w);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)r;
    while (n--) c = crc_hw_byte(c, *p++);
    return c;
}

/* Four pages at once: four independent dependency chains keep the crc32 unit busy. */
CRC_HW_TARGET static void crc_hw_pages4(const uint8_t *p, uint32_t *out) {
    crc_reg_t a = 0xFFFFFFFFu, b = a, c = a, d = a;
    for (size_t k = 0; k < PAGE; k += 8) {
        uint64_t wa, wb, wc, wd;
        memcpy(&wa, p + k, 8);
        memcpy(&wb, p + PAGE + k, 8);
        memcpy(&wc, p + 2 * PAGE + k, 8);
        memcpy(&wd, p + 3 * PAGE + k, 8);
        a = crc_hw_word(a, wa);
        b = crc_hw_word(b, wb);
        c = crc_hw_word(c, wc);
        d = crc_hw_word(d, wd);
    }
    out[0] = ~(uint32_t)a; out[1] = ~(uint32_t)b; out[2] = ~(uint32_t)c; out[3] = ~(uint32_t)d;
}

/* One page as four 1 KiB chains: the first from the initial register, the others from 0, joined
   by crc(A B) = skip(crc(A)) ^ crc_from_0(B). */
CRC_HW_TARGET static uint32_t crc_hw_page(const uint8_t *p) {
    crc_reg_t a = 0xFFFFFFFFu, b = 0, c = 0, d = 0;
    for (size_t k = 0; k < CRC_CHUNK; k += 8) {
        uint64_t wa, wb, wc, wd;
        memcpy(&wa, p + k, 8);
        memcpy(&wb, p + CRC_CHUNK + k, 8);
        memcpy(&wc, p + 2 * CRC_CHUNK + k, 8);
        memcpy(&wd, p + 3 * CRC_CHUNK + k, 8);
        a = crc_hw_word(a, wa);
        b = crc_hw_word(b, wb);
        c = crc_hw_word(c, wc);
        d = crc_hw_word(d, wd);
    }
    uint32_t x = crc_skip_chunk((uint32_t)a) ^ (uint32_t)b;
    x = crc_skip_chunk(x) ^ (uint32_t)c;
    return ~(crc_skip_chunk(x) ^ (uint32_t)d);
}
#endif

int crc32c_hw_available(void) { return crc_hw; }

/* What crc32c_check_pages uses on this CPU: "sse4.2", "armv8-crc32" or "software" (tables). */
const char *crc32c_implementation(void) {
#ifdef HAVE_CRC_HW
    if (crc_hw) return CRC_HW_NAME;
#endif
    return "software";
}

uint32_t crc32c_any(uint32_t crc, const uint8_t *p, size_t n, int hw) {
#ifdef HAVE_CRC_HW
    if (hw) return ~crc_hw_run(~crc, p, n);
#endif
    (void)hw;
    return ~crc_sw(~crc, p, n);
}

/* out[i] = crc32c of page i of p (npages whole pages); hw: may use the crc32c instruction (else tables). */
void crc32c_pages_any(const uint8_t *p, int64_t npages, uint32_t *out, int hw) {
    int64_t i = 0;
#ifdef HAVE_CRC_HW
    if (hw) {
        for (; i + 4 <= npages; i += 4) crc_hw_pages4(p + i * PAGE, out + i);
        for (; i < npages; i++) out[i] = crc_hw_page(p + i * PAGE);
    }
#endif
    for (; i < npages; i++) out[i] = ~crc_sw(0xFFFFFFFFu, p + i * PAGE, PAGE);
}

/* Check npages (at most MAX_CHECKED_PAGES) pages at p, pages first.. of their file, against
   expected[first..]; failures go to bad[(*nbad)++]. Returns the mask of failures. */
uint64_t crc32c_check_pages(const uint8_t *p, int64_t first, int64_t npages, const uint32_t *expected,
                                   int64_t *bad, int64_t *nbad) {
    uint32_t got[MAX_CHECKED_PAGES];
    uint64_t mask = 0;
    crc32c_pages_any(p, npages, got, crc_hw);
    for (int64_t k = 0; k < npages; k++) {
        if (got[k] != expected[first + k]) {
            mask |= (uint64_t)1 << k;
            bad[(*nbad)++] = first + k;
        }
    }
    return mask;
}
