// The op namespace of this build: one per kernel variant (kernels/cpu_build.py passes
// -DRINGSERVE_NS=ringserve_<variant>), so that several variants load side by side.

#pragma once

#include <torch/library.h>

#ifndef RINGSERVE_NS
#define RINGSERVE_NS ringserve
#endif

// NOTE: one level of indirection, so that RINGSERVE_NS is expanded before torch's macros
// stringify their namespace argument.
#define RINGSERVE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define RINGSERVE_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define RINGSERVE_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
