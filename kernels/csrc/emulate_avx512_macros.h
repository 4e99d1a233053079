// The AVX-512 macros of an emulated build (emulate_avx512.h), forced into each source after
// the precompiled headers. Not in them: GCC does not restore a target macro such as
// __AVX512F__ from a precompiled header whose target lacks it (measured: the sources then
// compiled their AVX2 branches).

#pragma once

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#if defined(RINGSERVE_EMULATE_BF16)
#define __AVX512BF16__ 1
#define __AVX512VNNI__ 1
#endif
