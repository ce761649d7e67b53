// Precompiled header for the translation units that use libtorch (ops, reference,
// nn, models, CLI, tests). Kernels (src/kernels) must never include it.
#pragma once
#include <torch/torch.h>
