/* The copy with non-temporal ("streaming") stores that tierkv's C helpers share:
 * tierkv._streamcopy (arrays into and out of the pool) and tierkv._piecewise (chunk files
 * into the pool). Included by both (static functions: each module has its own copy of the
 * code, one definition in the source).
 *
 * stream_pick() returns the best copy this CPU has: AVX2 or SSE2 streaming stores on
 * x86-64 (whole cache lines written to memory without reading them first, and without
 * evicting the caller's working set), memcpy elsewhere. After streaming, an _mm_sfence()
 * (stream_fence()) makes the lines visible to every core.
 */
#ifndef TIERKV_STREAM_H
#define TIERKV_STREAM_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_STREAM 1
#endif

/* Shorter copies: memcpy. The streaming functions need at least 32 bytes past the
 * destination's alignment; below a few cache lines streaming buys nothing. */
#define MIN_STREAM 256

typedef void (*run_copy)(char *dst, const char *src, size_t n);

static void
plain(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}

#ifdef HAVE_STREAM
/* Streaming stores need aligned destinations: the head up to the alignment and the tail
 * are memcpy'd. */
static void
stream_sse2(char *dst, const char *src, size_t n)
{
    size_t i = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, i);
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}

__attribute__((target("avx2"))) static void
stream_avx2(char *dst, const char *src, size_t n)
{
    size_t i = (32 - ((uintptr_t)dst & 31)) & 31;
    memcpy(dst, src, i);
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#endif

/* The best streaming copy of this CPU (call once, at import). */
static run_copy
stream_pick(void)
{
#ifdef HAVE_STREAM
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? stream_avx2 : stream_sse2;
#else
    return plain;
#endif
}

/* Streamed lines visible to every core from here. */
static inline void
stream_fence(void)
{
#ifdef HAVE_STREAM
    _mm_sfence();
#endif
}

/* "avx2", "sse2" or "memcpy": what stream_pick() chose. */
static const char *
stream_kind(run_copy chosen)
{
#ifdef HAVE_STREAM
    if (chosen == stream_avx2)
        return "avx2";
    if (chosen == stream_sse2)
        return "sse2";
#endif
    (void)chosen;
    return "memcpy";
}

#endif /* TIERKV_STREAM_H */
