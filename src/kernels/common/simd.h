// The one place the kernels include the AVX-512 intrinsics. Every kernel is
// compiled for the build machine (-march=native by default), so __AVX512F__
// says whether the vector paths exist; code under it must keep a scalar twin.
#pragma once

#ifdef __AVX512F__
// GCC 12's intrinsics headers trip -Wmaybe-uninitialized on their own
// _mm512_undefined_* (GCC bug 105593); the warning points into the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
