/* Hot loops of the lookup path that Python cannot make fast enough.
 *
 * A 32k-token lookup packs 32,768 Python ints in the client and hashes 128 chunks in the
 * server. In Python that is 0.25 ms of struct conversions and 128 calls into the blake3
 * package at about 1.9 us each: half of a 1 ms budget. This module does both in C:
 *
 *   pack_int32(list_or_tuple) -> bytes | None
 *       little-endian int32s; None when an item is not an int or does not fit (the
 *       caller falls back to the general path, which also words the error).
 *   chain_links(previous: 32 bytes, data: buffer, chunk_bytes, count) -> list[bytes]
 *       the chunk-key chain of kvdepot.keys, BLAKE3 written from its specification.
 *
 * Everything here is optional: kvdepot.native falls back to struct and the blake3
 * package when this extension was not built, with identical results (the tests compare
 * the two on many lengths).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---- pack_int32 ---------------------------------------------------------------------- */

/* An int's value without a function call when it fits one internal digit (30 bits on
 * 64-bit builds: any token id); the general conversion otherwise. */
static inline long long small_int_value(PyObject *item, int *overflow) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        return (long long)PyUnstable_Long_CompactValue((PyLongObject *)item);
    }
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size >= -1 && size <= 1) {
        return (long long)size * (long long)((PyLongObject *)item)->ob_digit[0];
    }
#endif
    return PyLong_AsLongLongAndOverflow(item, overflow);
}

static PyObject *pack_int32(PyObject *module, PyObject *arg) {
    (void)module;
    if (!PyList_CheckExact(arg) && !PyTuple_CheckExact(arg)) {
        Py_RETURN_NONE;
    }
    /* Only exact ints are converted, so no Python code (an __index__) runs inside the
     * loop and the list cannot change under it. */
    Py_ssize_t n = PyList_CheckExact(arg) ? PyList_GET_SIZE(arg) : PyTuple_GET_SIZE(arg);
    PyObject **items = PyList_CheckExact(arg) ? ((PyListObject *)arg)->ob_item
                                              : ((PyTupleObject *)arg)->ob_item;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        int overflow = 0;
        long long v = small_int_value(item, &overflow);
        if (overflow || v < INT32_MIN || v > INT32_MAX) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        uint32_t u = (uint32_t)(int32_t)v;
        p[0] = (unsigned char)u;
        p[1] = (unsigned char)(u >> 8);
        p[2] = (unsigned char)(u >> 16);
        p[3] = (unsigned char)(u >> 24);
        p += 4;
    }
    return out;
}

/* ---- BLAKE3 (plain and keyed-hash modes), from its specification ---------------------- */

enum {
    CHUNK_LEN = 1024,
    BLOCK_LEN = 64,
    CHUNK_START = 1,
    CHUNK_END = 2,
    PARENT = 4,
    ROOT = 8,
    KEYED_HASH = 16,
};

static const uint32_t IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                               0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};

/* The message word permutation applied between rounds. */
static const uint8_t PERMUTATION[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};

/* SCHEDULE[r][i]: which original message word round r uses in position i (filled once
 * at import from PERMUTATION, so no round shuffles words at run time). */
static uint8_t SCHEDULE[7][16];

static void fill_schedule(void) {
    for (int i = 0; i < 16; i++) {
        SCHEDULE[0][i] = (uint8_t)i;
    }
    for (int r = 1; r < 7; r++) {
        for (int i = 0; i < 16; i++) {
            SCHEDULE[r][i] = SCHEDULE[r - 1][PERMUTATION[i]];
        }
    }
}

static inline uint32_t load32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static inline uint32_t rotr32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

#define G(a, b, c, d, x, y)          \
    do {                             \
        a = a + b + (x);             \
        d = rotr32(d ^ a, 16);       \
        c = c + d;                   \
        b = rotr32(b ^ c, 12);       \
        a = a + b + (y);             \
        d = rotr32(d ^ a, 8);        \
        c = c + d;                   \
        b = rotr32(b ^ c, 7);        \
    } while (0)

/* The seven rounds, for any G: the scalar one above or a vector one running lanes side
 * by side. State words s0..s15 and message words m[] are the caller's variables. */
#define ROUNDS(G_, m)                                   \
    for (int r = 0; r < 7; r++) {                       \
        const uint8_t *w = SCHEDULE[r];                 \
        G_(s0, s4, s8, s12, m[w[0]], m[w[1]]);          \
        G_(s1, s5, s9, s13, m[w[2]], m[w[3]]);          \
        G_(s2, s6, s10, s14, m[w[4]], m[w[5]]);         \
        G_(s3, s7, s11, s15, m[w[6]], m[w[7]]);         \
        G_(s0, s5, s10, s15, m[w[8]], m[w[9]]);         \
        G_(s1, s6, s11, s12, m[w[10]], m[w[11]]);       \
        G_(s2, s7, s8, s13, m[w[12]], m[w[13]]);        \
        G_(s3, s4, s9, s14, m[w[14]], m[w[15]]);        \
    }

/* One compression; writes the 8-word chaining value (the first half of the output). */
static void compress(const uint32_t cv[8], const unsigned char block[BLOCK_LEN],
                     uint32_t block_len, uint64_t counter, uint32_t flags, uint32_t out[8]) {
    uint32_t m[16];
    for (int i = 0; i < 16; i++) {
        m[i] = load32(block + 4 * i);
    }
    uint32_t s0 = cv[0], s1 = cv[1], s2 = cv[2], s3 = cv[3];
    uint32_t s4 = cv[4], s5 = cv[5], s6 = cv[6], s7 = cv[7];
    uint32_t s8 = IV[0], s9 = IV[1], s10 = IV[2], s11 = IV[3];
    uint32_t s12 = (uint32_t)counter, s13 = (uint32_t)(counter >> 32);
    uint32_t s14 = block_len, s15 = flags;
    ROUNDS(G, m);
    out[0] = s0 ^ s8;
    out[1] = s1 ^ s9;
    out[2] = s2 ^ s10;
    out[3] = s3 ^ s11;
    out[4] = s4 ^ s12;
    out[5] = s5 ^ s13;
    out[6] = s6 ^ s14;
    out[7] = s7 ^ s15;
}

/* The chaining value of one chunk (1..1024 bytes; 0 only for the empty input).
 * `root` marks its last block as the root: the whole input is this one chunk. */
static void chunk_cv(const uint32_t key[8], uint32_t mode, const unsigned char *data,
                     size_t len, uint64_t counter, int root, uint32_t out[8]) {
    uint32_t cv[8];
    memcpy(cv, key, sizeof cv);
    size_t offset = 0;
    do {
        size_t take = len - offset < BLOCK_LEN ? len - offset : BLOCK_LEN;
        unsigned char block[BLOCK_LEN] = {0};
        memcpy(block, data + offset, take);
        uint32_t flags = mode;
        if (offset == 0) {
            flags |= CHUNK_START;
        }
        if (offset + take >= len) {
            flags |= CHUNK_END | (root ? ROOT : 0);
        }
        compress(cv, block, (uint32_t)take, counter, flags, cv);
        offset += take;
    } while (offset < len);
    memcpy(out, cv, sizeof cv);
}

static void store_words(unsigned char *dst, const uint32_t *words, int count) {
    for (int i = 0; i < count; i++) {
        dst[4 * i] = (unsigned char)words[i];
        dst[4 * i + 1] = (unsigned char)(words[i] >> 8);
        dst[4 * i + 2] = (unsigned char)(words[i] >> 16);
        dst[4 * i + 3] = (unsigned char)(words[i] >> 24);
    }
}

/* The chaining value of the subtree over `len` bytes starting at chunk `counter`. The
 * left subtree holds the largest power of two of chunks that leaves at least one byte
 * to the right. With `root` set, the result is the hash of the whole input. */
static void subtree_cv(const uint32_t key[8], uint32_t mode, const unsigned char *data,
                       size_t len, uint64_t counter, int root, uint32_t out[8]) {
    if (len <= CHUNK_LEN) {
        chunk_cv(key, mode, data, len, counter, root, out);
        return;
    }
    size_t chunks = (len + CHUNK_LEN - 1) / CHUNK_LEN;
    size_t left_chunks = 1;
    while (left_chunks * 2 < chunks) {
        left_chunks *= 2;
    }
    size_t left_len = left_chunks * CHUNK_LEN;
    uint32_t children[16];
    subtree_cv(key, mode, data, left_len, counter, 0, children);
    subtree_cv(key, mode, data + left_len, len - left_len, counter + left_chunks, 0,
               children + 8);
    unsigned char block[BLOCK_LEN];
    store_words(block, children, 16);
    compress(key, block, BLOCK_LEN, 0, mode | PARENT | (root ? ROOT : 0), out);
}

/* ---- several single-chunk inputs at once: what every SIMD width shares ---------------- */

/* Where each lane's block at `offset` starts: in its input, or, for a partial last block,
 * in a zero-padded copy in `padded`. */
static void lane_blocks(const unsigned char *const *inputs, int lanes, size_t offset,
                        size_t take, unsigned char (*padded)[BLOCK_LEN],
                        const unsigned char **src) {
    for (int l = 0; l < lanes; l++) {
        src[l] = inputs[l] + offset;
        if (take < BLOCK_LEN) {
            memset(padded[l], 0, BLOCK_LEN);
            memcpy(padded[l], src[l], take);
            src[l] = padded[l];
        }
    }
}

/* Flags of block `b` of a `blocks`-block input that is one whole chunk (the root). */
static inline uint32_t single_chunk_flags(size_t b, size_t blocks) {
    return (b == 0 ? CHUNK_START : 0) | (b + 1 == blocks ? CHUNK_END | ROOT : 0);
}

/* `words` holds word i of lane l at [i * lanes + l]; out[l] gets lane l's 8 words. */
static void lanes_to_digests(const uint32_t *words, int lanes, uint32_t (*out)[8]) {
    for (int l = 0; l < lanes; l++) {
        for (int i = 0; i < 8; i++) {
            out[l][i] = words[i * lanes + l];
        }
    }
}

/* ---- four single-chunk inputs at once (SSE2: every x86-64 CPU has it) ----------------- */

#if defined(__SSE2__)
#include <emmintrin.h>

static inline __m128i rotr_v(__m128i x, int n) {
    return _mm_or_si128(_mm_srli_epi32(x, n), _mm_slli_epi32(x, 32 - n));
}

static inline __m128i rotr16_v(__m128i x) {
    /* Swapping the 16-bit halves of each lane is a rotation by 16. */
    return _mm_shufflehi_epi16(_mm_shufflelo_epi16(x, 0xB1), 0xB1);
}

#define GV(a, b, c, d, x, y)                                   \
    do {                                                       \
        a = _mm_add_epi32(_mm_add_epi32(a, b), (x));           \
        d = rotr16_v(_mm_xor_si128(d, a));                     \
        c = _mm_add_epi32(c, d);                               \
        b = rotr_v(_mm_xor_si128(b, c), 12);                   \
        a = _mm_add_epi32(_mm_add_epi32(a, b), (y));           \
        d = rotr_v(_mm_xor_si128(d, a), 8);                    \
        c = _mm_add_epi32(c, d);                               \
        b = rotr_v(_mm_xor_si128(b, c), 7);                    \
    } while (0)

/* Plain (unkeyed) BLAKE3 of four inputs of the same length, 1..1024 bytes each: one
 * lane per input, so the four compressions of each block run side by side. */
static void hash4_single_chunk(const unsigned char *const inputs[4], size_t len,
                               uint32_t out[4][8]) {
    __m128i cv[8];
    for (int i = 0; i < 8; i++) {
        cv[i] = _mm_set1_epi32((int)IV[i]);
    }
    size_t blocks = (len + BLOCK_LEN - 1) / BLOCK_LEN;
    for (size_t b = 0; b < blocks; b++) {
        size_t offset = b * BLOCK_LEN;
        size_t take = len - offset < BLOCK_LEN ? len - offset : BLOCK_LEN;
        const unsigned char *src[4];
        unsigned char padded[4][BLOCK_LEN];
        lane_blocks(inputs, 4, offset, take, padded, src);
        __m128i m[16];
        for (int q = 0; q < 4; q++) {  /* transpose 4x4 words: m[j] holds word j of each lane */
            __m128i r0 = _mm_loadu_si128((const __m128i *)(src[0] + 16 * q));
            __m128i r1 = _mm_loadu_si128((const __m128i *)(src[1] + 16 * q));
            __m128i r2 = _mm_loadu_si128((const __m128i *)(src[2] + 16 * q));
            __m128i r3 = _mm_loadu_si128((const __m128i *)(src[3] + 16 * q));
            __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpackhi_epi32(r0, r1);
            __m128i t2 = _mm_unpacklo_epi32(r2, r3), t3 = _mm_unpackhi_epi32(r2, r3);
            m[4 * q] = _mm_unpacklo_epi64(t0, t2);
            m[4 * q + 1] = _mm_unpackhi_epi64(t0, t2);
            m[4 * q + 2] = _mm_unpacklo_epi64(t1, t3);
            m[4 * q + 3] = _mm_unpackhi_epi64(t1, t3);
        }
        uint32_t flags = single_chunk_flags(b, blocks);
        __m128i s0 = cv[0], s1 = cv[1], s2 = cv[2], s3 = cv[3];
        __m128i s4 = cv[4], s5 = cv[5], s6 = cv[6], s7 = cv[7];
        __m128i s8 = _mm_set1_epi32((int)IV[0]), s9 = _mm_set1_epi32((int)IV[1]);
        __m128i s10 = _mm_set1_epi32((int)IV[2]), s11 = _mm_set1_epi32((int)IV[3]);
        __m128i s12 = _mm_setzero_si128(), s13 = _mm_setzero_si128();  /* chunk counter 0 */
        __m128i s14 = _mm_set1_epi32((int)take), s15 = _mm_set1_epi32((int)flags);
        ROUNDS(GV, m);
        cv[0] = _mm_xor_si128(s0, s8);
        cv[1] = _mm_xor_si128(s1, s9);
        cv[2] = _mm_xor_si128(s2, s10);
        cv[3] = _mm_xor_si128(s3, s11);
        cv[4] = _mm_xor_si128(s4, s12);
        cv[5] = _mm_xor_si128(s5, s13);
        cv[6] = _mm_xor_si128(s6, s14);
        cv[7] = _mm_xor_si128(s7, s15);
    }
    uint32_t words[8][4];
    for (int i = 0; i < 8; i++) {
        _mm_storeu_si128((__m128i *)words[i], cv[i]);
    }
    lanes_to_digests(&words[0][0], 4, out);
}
#endif

/* ---- eight single-chunk inputs at once (AVX2, where the CPU has it) ------------------- */

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define HAVE_AVX2_PATH 1
#include <immintrin.h>

#define AVX2_FN __attribute__((target("avx2")))

AVX2_FN static inline __m256i rotr_w(__m256i x, int n) {
    return _mm256_or_si256(_mm256_srli_epi32(x, n), _mm256_slli_epi32(x, 32 - n));
}

/* Rotations by 16 and 8 move whole bytes: one byte shuffle each. */
AVX2_FN static inline __m256i rotr16_w(__m256i x) {
    const __m256i order = _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13,
                                           2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return _mm256_shuffle_epi8(x, order);
}

AVX2_FN static inline __m256i rotr8_w(__m256i x) {
    const __m256i order = _mm256_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12,
                                           1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
    return _mm256_shuffle_epi8(x, order);
}

#define GW(a, b, c, d, x, y)                                       \
    do {                                                           \
        a = _mm256_add_epi32(_mm256_add_epi32(a, b), (x));         \
        d = rotr16_w(_mm256_xor_si256(d, a));                      \
        c = _mm256_add_epi32(c, d);                                \
        b = rotr_w(_mm256_xor_si256(b, c), 12);                    \
        a = _mm256_add_epi32(_mm256_add_epi32(a, b), (y));         \
        d = rotr8_w(_mm256_xor_si256(d, a));                       \
        c = _mm256_add_epi32(c, d);                                \
        b = rotr_w(_mm256_xor_si256(b, c), 7);                     \
    } while (0)

/* As hash4_single_chunk, eight lanes wide. */
AVX2_FN static void hash8_single_chunk(const unsigned char *const inputs[8], size_t len,
                                       uint32_t out[8][8]) {
    __m256i cv[8];
    for (int i = 0; i < 8; i++) {
        cv[i] = _mm256_set1_epi32((int)IV[i]);
    }
    size_t blocks = (len + BLOCK_LEN - 1) / BLOCK_LEN;
    for (size_t b = 0; b < blocks; b++) {
        size_t offset = b * BLOCK_LEN;
        size_t take = len - offset < BLOCK_LEN ? len - offset : BLOCK_LEN;
        const unsigned char *src[8];
        unsigned char padded[8][BLOCK_LEN];
        lane_blocks(inputs, 8, offset, take, padded, src);
        __m256i m[16];
        for (int q = 0; q < 2; q++) {  /* transpose 8x8 words: m[j] holds word j of each lane */
            __m256i r[8], t[8], u[8];
            for (int l = 0; l < 8; l++) {
                r[l] = _mm256_loadu_si256((const __m256i *)(src[l] + 32 * q));
            }
            for (int p = 0; p < 8; p += 2) {
                t[p] = _mm256_unpacklo_epi32(r[p], r[p + 1]);
                t[p + 1] = _mm256_unpackhi_epi32(r[p], r[p + 1]);
            }
            for (int h = 0; h < 8; h += 4) {
                u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
                u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
                u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
                u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
            }
            for (int w = 0; w < 4; w++) {
                m[8 * q + w] = _mm256_permute2x128_si256(u[w], u[w + 4], 0x20);
                m[8 * q + w + 4] = _mm256_permute2x128_si256(u[w], u[w + 4], 0x31);
            }
        }
        uint32_t flags = single_chunk_flags(b, blocks);
        __m256i s0 = cv[0], s1 = cv[1], s2 = cv[2], s3 = cv[3];
        __m256i s4 = cv[4], s5 = cv[5], s6 = cv[6], s7 = cv[7];
        __m256i s8 = _mm256_set1_epi32((int)IV[0]), s9 = _mm256_set1_epi32((int)IV[1]);
        __m256i s10 = _mm256_set1_epi32((int)IV[2]), s11 = _mm256_set1_epi32((int)IV[3]);
        __m256i s12 = _mm256_setzero_si256(), s13 = _mm256_setzero_si256();
        __m256i s14 = _mm256_set1_epi32((int)take), s15 = _mm256_set1_epi32((int)flags);
        ROUNDS(GW, m);
        cv[0] = _mm256_xor_si256(s0, s8);
        cv[1] = _mm256_xor_si256(s1, s9);
        cv[2] = _mm256_xor_si256(s2, s10);
        cv[3] = _mm256_xor_si256(s3, s11);
        cv[4] = _mm256_xor_si256(s4, s12);
        cv[5] = _mm256_xor_si256(s5, s13);
        cv[6] = _mm256_xor_si256(s6, s14);
        cv[7] = _mm256_xor_si256(s7, s15);
    }
    uint32_t words[8][8];
    for (int i = 0; i < 8; i++) {
        _mm256_storeu_si256((__m256i *)words[i], cv[i]);
    }
    lanes_to_digests(&words[0][0], 8, out);
}
#endif

/* The widest batch in use: 8 (AVX2), 4 (SSE2) or 1. Set at import from the CPU's
 * features; tests narrow it to check every path against the reference. */
static int simd_width = 1;

static int widest_supported(void) {
#if defined(HAVE_AVX2_PATH)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        return 8;
    }
#endif
#if defined(__SSE2__)
    return 4;
#else
    return 1;
#endif
}

/* ---- chain links ----------------------------------------------------------------------- */

/* link = BLAKE3_keyed(key=previous link, BLAKE3(chunk)). The inner hashes do not depend
 * on each other, so they run eight (AVX2) or four (SSE2) at a time; only the cheap outer
 * step, one compression of 32 bytes, is sequential. */
static void chain(const unsigned char prev[32], const unsigned char *data, size_t chunk_bytes,
                  size_t count, unsigned char *out /* 32 * count */) {
    uint32_t inner[8][8];
    uint32_t key[8];
    for (int i = 0; i < 8; i++) {
        key[i] = load32(prev + 4 * i);
    }
    int single_chunk = chunk_bytes >= 1 && chunk_bytes <= CHUNK_LEN;
    for (size_t done = 0; done < count;) {
        size_t left = count - done, batch;
        const unsigned char *inputs[8];
        for (size_t l = 0; l < 8 && l < left; l++) {
            inputs[l] = data + (done + l) * chunk_bytes;
        }
#if defined(HAVE_AVX2_PATH)
        if (simd_width >= 8 && single_chunk && left >= 8) {
            hash8_single_chunk(inputs, chunk_bytes, inner);
            batch = 8;
        } else
#endif
#if defined(__SSE2__)
        if (simd_width >= 4 && single_chunk && left >= 4) {
            uint32_t four[4][8];
            hash4_single_chunk(inputs, chunk_bytes, four);
            memcpy(inner, four, sizeof four);
            batch = 4;
        } else
#endif
        {
            subtree_cv(IV, 0, inputs[0], chunk_bytes, 0, 1, inner[0]);
            batch = 1;
        }
        for (size_t l = 0; l < batch; l++) {
            unsigned char block[BLOCK_LEN] = {0};
            store_words(block, inner[l], 8);
            compress(key, block, 32, 0, KEYED_HASH | CHUNK_START | CHUNK_END | ROOT, key);
            store_words(out + 32 * (done + l), key, 8);
        }
        done += batch;
    }
}

#define RELEASE_GIL_BYTES ((size_t)4 << 20)

static PyObject *chain_links(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "chain_links(previous, data, chunk_bytes, count) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t chunk_bytes = PyLong_AsSsize_t(args[2]);
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if ((chunk_bytes == -1 || count == -1) && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer prev_buf, data_buf;
    if (PyObject_GetBuffer(args[0], &prev_buf, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &data_buf, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&prev_buf);
        return NULL;
    }
    PyObject *result = NULL;
    if (prev_buf.len != 32) {
        PyErr_SetString(PyExc_ValueError, "the previous link is 32 bytes");
    } else if (chunk_bytes < 1 || count < 0 || count > data_buf.len / chunk_bytes) {
        PyErr_Format(PyExc_ValueError, "%zd chunks of %zd bytes do not fit in %zd bytes", count,
                     chunk_bytes, data_buf.len);
    } else if ((result = PyList_New(count)) != NULL) {
        unsigned char *links = PyMem_Malloc(32 * (size_t)count + 1);
        if (links == NULL) {
            Py_CLEAR(result);
            PyErr_NoMemory();
        } else {
            /* A lookup's few hundred KiB take tens of microseconds: releasing the GIL
             * for them could hand it to a busy thread for a whole switch interval. */
            if ((size_t)count * (size_t)chunk_bytes >= RELEASE_GIL_BYTES) {
                Py_BEGIN_ALLOW_THREADS
                chain(prev_buf.buf, data_buf.buf, (size_t)chunk_bytes, (size_t)count, links);
                Py_END_ALLOW_THREADS
            } else {
                chain(prev_buf.buf, data_buf.buf, (size_t)chunk_bytes, (size_t)count, links);
            }
            for (Py_ssize_t i = 0; i < count; i++) {
                PyObject *link = PyBytes_FromStringAndSize((const char *)links + 32 * i, 32);
                if (link == NULL) {
                    Py_CLEAR(result);
                    break;
                }
                PyList_SET_ITEM(result, i, link);
            }
            PyMem_Free(links);
        }
    }
    PyBuffer_Release(&prev_buf);
    PyBuffer_Release(&data_buf);
    return result;
}

static PyObject *set_simd_width(PyObject *module, PyObject *arg) {
    (void)module;
    long wanted = PyLong_AsLong(arg);
    if (wanted == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int widest = widest_supported();
    simd_width = wanted >= 8 ? widest : wanted >= 4 ? (widest >= 4 ? 4 : 1) : 1;
    return PyLong_FromLong(simd_width);
}

static PyMethodDef METHODS[] = {
    {"pack_int32", pack_int32, METH_O,
     "Little-endian int32 bytes of a list or tuple of ints; None if it holds anything "
     "else or a value out of range."},
    {"chain_links", (PyCFunction)(void (*)(void))chain_links, METH_FASTCALL,
     "The next `count` chain links after `previous` over consecutive chunks of `data`: "
     "BLAKE3_keyed(previous link, BLAKE3(chunk)), 32 bytes each."},
    {"set_simd_width", set_simd_width, METH_O,
     "Use batches of at most 8, 4 or 1 chunks (capped by the CPU); returns the width now "
     "in use. For tests."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_native", NULL, -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    fill_schedule();
    simd_width = widest_supported();
    return PyModule_Create(&MODULE);
}
