// The one place the kernels include the x86 intrinsics. Each level's
// translation units are compiled with that level's -march (isa.h), so the
// compiler's macros say which vector paths exist in this one: __AVX512F__ at
// avx512 and above, __AVX2__ (with __FMA__) at avx2, neither at baseline or on
// other architectures. Code under them keeps a scalar twin.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's intrinsics headers trip -Wmaybe-uninitialized (and, where a
// masked op is inlined into a loop, -Wuninitialized) on their own
// _mm512_undefined_* (GCC bug 105593); the warning points into the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif

/// The AVX2 paths need FMA too; x86-64-v3 (the avx2 level) has both.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ATTNKIT_AVX2 1
#else
#define ATTNKIT_AVX2 0
#endif
