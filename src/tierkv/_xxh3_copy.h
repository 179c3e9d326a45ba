/* A copy with streaming stores that computes the XXH3-128 checksum (seed 0, default secret)
 * of the bytes it copies, in the same pass: each 64-byte stripe is loaded once, stored to the
 * destination and folded into the hash's accumulators while in registers. Included by
 * tierkv._piecewise, whose mapped disk reads copied a piece and then hashed it again from
 * the caches (about a fifth of a read's time).
 *
 * Only for more than 240 bytes (XXH3's long-input path; shorter inputs hash differently) and
 * x86-64 CPUs with AVX2. The result is bit for bit XXH3_128bits() of the source: this follows
 * XXH3's specification (accumulate every 64-byte stripe with an 8-byte step through the
 * secret, scramble the accumulators after each 1024-byte block, the last stripe with its own
 * secret offset, two merges for the two halves), with the specification's constants; the
 * tests compare it with libxxhash over many lengths and alignments.
 */
#ifndef TIERKV_XXH3_COPY_H
#define TIERKV_XXH3_COPY_H

#include <sched.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_XXH3_COPY 1

#define XC_MIN_LEN 241 /* shorter inputs take XXH3's short paths */
#define XC_STRIPE 64
#define XC_BLOCK 1024 /* 16 stripes: (secret size 192 - 64) / 8 */
#define XC_SECRET_SIZE 192

/* XXH3's default secret (the specification's kSecret). */
static const uint8_t xc_secret[XC_SECRET_SIZE] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define XC_PRIME32_1 0x9E3779B1U
#define XC_PRIME32_2 0x85EBCA77U
#define XC_PRIME32_3 0xC2B2AE3DU
#define XC_PRIME64_1 0x9E3779B185EBCA87ULL
#define XC_PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define XC_PRIME64_3 0x165667B19E3779F9ULL
#define XC_PRIME64_4 0x85EBCA77C2B2AE63ULL
#define XC_PRIME64_5 0x27D4EB2F165667C5ULL

/* One stripe (d0, d1: its two halves) into the accumulators, with the secret at ``key``. */
__attribute__((target("avx2"))) static inline void
xc_accumulate(__m256i acc[2], __m256i d0, __m256i d1, const uint8_t *key)
{
    __m256i k0 = _mm256_loadu_si256((const __m256i *)key);
    __m256i k1 = _mm256_loadu_si256((const __m256i *)(key + 32));
    __m256i dk0 = _mm256_xor_si256(d0, k0);
    __m256i dk1 = _mm256_xor_si256(d1, k1);
    /* acc[i] += lo32(data ^ key) * hi32(data ^ key), and acc[i ^ 1] += data[i] */
    __m256i p0 = _mm256_mul_epu32(dk0, _mm256_shuffle_epi32(dk0, _MM_SHUFFLE(0, 3, 0, 1)));
    __m256i p1 = _mm256_mul_epu32(dk1, _mm256_shuffle_epi32(dk1, _MM_SHUFFLE(0, 3, 0, 1)));
    __m256i s0 = _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2));
    __m256i s1 = _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2));
    acc[0] = _mm256_add_epi64(p0, _mm256_add_epi64(acc[0], s0));
    acc[1] = _mm256_add_epi64(p1, _mm256_add_epi64(acc[1], s1));
}

/* After each block: acc = (acc ^ (acc >> 47) ^ key) * PRIME32_1. */
__attribute__((target("avx2"))) static inline void
xc_scramble(__m256i acc[2])
{
    const uint8_t *key = xc_secret + XC_SECRET_SIZE - XC_STRIPE;
    const __m256i prime = _mm256_set1_epi32((int)XC_PRIME32_1);
    for (int i = 0; i < 2; i++) {
        __m256i a = _mm256_xor_si256(acc[i], _mm256_srli_epi64(acc[i], 47));
        __m256i dk = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(key + 32 * i)));
        __m256i hi = _mm256_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
        acc[i] = _mm256_add_epi64(_mm256_mul_epu32(dk, prime),
                                  _mm256_slli_epi64(_mm256_mul_epu32(hi, prime), 32));
    }
}

static inline uint64_t
xc_read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* x86-64: little-endian, as XXH3 reads */
}

static inline uint64_t
xc_fold64(uint64_t a, uint64_t b)
{
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static uint64_t
xc_merge(const uint64_t acc[8], const uint8_t *key, uint64_t h)
{
    for (int i = 0; i < 4; i++)
        h += xc_fold64(acc[2 * i] ^ xc_read64(key + 16 * i),
                       acc[2 * i + 1] ^ xc_read64(key + 16 * i + 8));
    h ^= h >> 37; /* XXH3's avalanche */
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

/* One stripe copied (streaming stores: dst 32-byte aligned) and accumulated. */
#define XC_STRIPE_STEP(dst, src, key)                                                       \
    do {                                                                                    \
        __m256i d0_ = _mm256_loadu_si256((const __m256i *)(src));                          \
        __m256i d1_ = _mm256_loadu_si256((const __m256i *)((src) + 32));                   \
        _mm256_stream_si256((__m256i *)(dst), d0_);                                         \
        _mm256_stream_si256((__m256i *)((dst) + 32), d1_);                                  \
        xc_accumulate(acc, d0_, d1_, (key));                                                \
    } while (0)

/* Copy n > 240 bytes from src to dst (32-byte aligned) with streaming stores and return
 * XXH3_128bits(src, n) as (high, low); sched_yield() after each ``piece`` bytes (a multiple
 * of XC_BLOCK) when ``give_way``. The caller fences the stores (stream_fence()). */
__attribute__((target("avx2"))) static void
xxh3_copy_avx2(char *dst, const char *src, size_t n, size_t piece, int give_way,
               uint64_t *high, uint64_t *low)
{
    __m256i acc[2] = {
        _mm256_set_epi64x((long long)XC_PRIME64_3, (long long)XC_PRIME64_2,
                          (long long)XC_PRIME64_1, (long long)XC_PRIME32_3),
        _mm256_set_epi64x((long long)XC_PRIME32_1, (long long)XC_PRIME64_5,
                          (long long)XC_PRIME32_2, (long long)XC_PRIME64_4),
    };
    const uint8_t *in = (const uint8_t *)src;
    size_t blocks = (n - 1) / XC_BLOCK;
    size_t pos = 0;
    for (size_t b = 0; b < blocks; b++) {
        for (int s = 0; s < XC_BLOCK / XC_STRIPE; s++, pos += XC_STRIPE)
            XC_STRIPE_STEP(dst + pos, src + pos, xc_secret + 8 * s);
        xc_scramble(acc);
        if (give_way && pos % piece == 0 && pos < n)
            sched_yield();
    }
    size_t stripes = ((n - 1) - pos) / XC_STRIPE; /* the last, partial block */
    for (size_t s = 0; s < stripes; s++, pos += XC_STRIPE)
        XC_STRIPE_STEP(dst + pos, src + pos, xc_secret + 8 * s);
    memcpy(dst + pos, src + pos, n - pos); /* 1 to 64 bytes: copied, hashed below */
    /* The last stripe: the input's last 64 bytes (overlapping what came before). */
    xc_accumulate(acc, _mm256_loadu_si256((const __m256i *)(in + n - XC_STRIPE)),
                  _mm256_loadu_si256((const __m256i *)(in + n - 32)),
                  xc_secret + XC_SECRET_SIZE - XC_STRIPE - 7);
    uint64_t a[8] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)a, acc[0]);
    _mm256_store_si256((__m256i *)(a + 4), acc[1]);
    *low = xc_merge(a, xc_secret + 11, (uint64_t)n * XC_PRIME64_1);
    *high = xc_merge(a, xc_secret + XC_SECRET_SIZE - 64 - 11, ~((uint64_t)n * XC_PRIME64_2));
}
#endif /* __x86_64__ */

#endif /* TIERKV_XXH3_COPY_H */
