// Umbrella header: everything a C++ user of attnkit needs.
#pragma once

#include <attnkit/block_mask.h>
#include <attnkit/dispatch.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <attnkit/document_memory.h>
#include <attnkit/nn/zoo.h>
#include <attnkit/nn/multihead.h>
#include <attnkit/nn/clustered_attention.h>
#include <attnkit/nn/agglomerative_attention.h>
#include <attnkit/nn/dense.h>
#include <attnkit/nn/gated_linear_attention.h>
#include <attnkit/nn/linear_attention.h>
#include <attnkit/nn/decoding.h>
#include <attnkit/nn/registry.h>
#include <attnkit/models/transformer.h>
#include <attnkit/tasks/task.h>
#include <attnkit/tasks/char_lm.h>
#include <attnkit/tasks/copy.h>
