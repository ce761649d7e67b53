// Deprecated: renamed <attnkit/nn/clustered_attention.h> (CHANGELOG, "one file stem per
// mechanism"). This forwarding header stays for one release, then goes.
#pragma once

#include <attnkit/nn/clustered_attention.h>
