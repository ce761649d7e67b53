// Deprecated: renamed <attnkit/nn/linear_attention.h> (CHANGELOG, "one file stem per
// mechanism"). This forwarding header stays for one release, then goes.
#pragma once

#include <attnkit/nn/linear_attention.h>
